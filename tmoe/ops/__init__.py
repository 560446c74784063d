"""Every ``torch.ops.tmoe.*`` custom op: the one package that touches ``torch.library``.
Importing it registers the stage ops (``stages``) and the layer ops (``layer``)."""
from tmoe.ops import layer, stages

__all__ = ["layer", "stages"]
