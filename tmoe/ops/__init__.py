"""Every ``torch.ops.tmoe.*`` custom op: the one package that touches ``torch.library``.
Importing it registers the stage ops (``stages``, ``quant``), the layer ops (``layer``) and their
FLOP formulas (``flops``)."""
from tmoe.ops import flops, layer, quant, stages

flops.register_all()

__all__ = ["flops", "layer", "quant", "stages"]
