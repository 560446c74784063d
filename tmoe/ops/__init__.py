"""Every ``torch.ops.tmoe.*`` custom op: the one package that touches ``torch.library``.
Importing it registers the stage ops (``stages``, ``quant``), the layer ops (``layer``) and their
FLOP formulas (``flops``), and tags torch.compile's cache keys with their sources (``cache_tag``)."""
from tmoe.ops import cache_tag, flops, layer, quant, stages

flops.register_all()
cache_tag.tag_compile_caches()

__all__ = ["cache_tag", "flops", "layer", "quant", "stages"]
