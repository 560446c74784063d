"""``RecordOps``: a dispatch mode that runs every op unchanged and records its name."""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class RecordOps(TorchDispatchMode):
    """Within the block, every op runs as it would and ``names`` lists each call's schema name in
    order (``"aten::bmm"``, ``"tmoe::moe_grad_weight"``): what a layer call or a backward launched."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._schema.name)
        return func(*args, **(kwargs or {}))
