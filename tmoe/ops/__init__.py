"""Every ``torch.ops.tmoe.*`` custom op: the one package that touches ``torch.library``.
Importing it registers the stage ops (``stages``), the layer ops (``layer``) and their FLOP
formulas (``flops``)."""
from tmoe.ops import flops, layer, stages

flops.register_all()

__all__ = ["flops", "layer", "stages"]
