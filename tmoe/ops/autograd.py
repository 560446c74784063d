"""tmoe's ops are inference-only: an autograd formula that says so, instead of torch's generic
"no autograd formula" error at backward time."""
from __future__ import annotations

from torch._library.custom_ops import CustomOpDef


def inference_only(op: CustomOpDef) -> None:
    """Register a backward for ``op`` that raises a clear error (the forward still records a grad_fn)."""
    name = op._qualname

    def backward(ctx, *grads):
        raise RuntimeError(f"{name} is inference-only: tmoe has no backward pass (no training support yet); "
                           "run it under torch.no_grad() / torch.inference_mode() or detach its inputs")

    op.register_autograd(backward)
