"""Input checks that run before any kernel launch and name the offending argument."""
from __future__ import annotations

import functools
from typing import Callable, Iterable, TypeVar

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn,)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(
    name: str,
    t: object,
    *,
    dtypes: Iterable[torch.dtype] | None = None,
    ndim: int | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Raise TypeError/ValueError naming ``name`` unless ``t`` is a tensor as described."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along its last dimension (stride {t.stride(-1)})")


def boolean(name: str, value: object) -> bool:
    """``value`` if it is a bool, else a TypeError naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def positive_int(name: str, value: object) -> int:
    """``value`` if it is a positive int (not a bool), else a TypeError/ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def check_align_outputs(sorted_ids: object, expert_ids: object, num_post_padded: object,
                        device: torch.device) -> int:
    """The align stage's int32 outputs on ``device`` (sorted_token_ids (P,), expert_ids,
    num_tokens_post_padded (1,)), as a backward op takes them; returns P."""
    check_tensor("sorted_token_ids", sorted_ids, dtypes=(torch.int32,), ndim=1, device=device)
    check_tensor("expert_ids", expert_ids, dtypes=(torch.int32,), ndim=1, device=device)
    check_tensor("num_tokens_post_padded", num_post_padded, dtypes=(torch.int32,), device=device)
    check_shape("num_tokens_post_padded", num_post_padded, (1,))
    return sorted_ids.shape[0]


def check_router_weights(topk_weights: object, tokens: int | None, device: torch.device) -> None:
    """float32 (tokens, topk) router weights, contiguous, on ``device`` (``tokens`` None: any rows)."""
    check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), ndim=2, device=device, contiguous=True)
    if tokens is not None and topk_weights.shape[0] != tokens:
        raise ValueError(f"topk_weights must have one row per token ({tokens}), got shape {tuple(topk_weights.shape)}")


class CompiledTypeError(TypeError, IndexError):
    """A TypeError of tmoe's checks raised while torch.compile traces (``compile_visible``)."""


class CompiledValueError(ValueError, IndexError):
    """A ValueError of tmoe's checks raised while torch.compile traces (``compile_visible``)."""


class CompiledNotImplementedError(ValueError, IndexError):
    """A NotImplementedError of tmoe's checks (no backward for this call) raised while torch.compile
    traces: a ValueError there, since dynamo turns a NotImplementedError from a fake into a graph break."""


_COMPILED = ((NotImplementedError, CompiledNotImplementedError), (TypeError, CompiledTypeError),
             (ValueError, CompiledValueError))
F = TypeVar("F", bound=Callable)


def compile_visible(fn: F) -> F:
    """``fn`` (an op's fake or autograd setup: what torch.compile runs on fake tensors as it traces)
    with its TypeError, ValueError and NotImplementedError re-raised while tracing as the
    ``Compiled*Error`` of that type, same message. They are also IndexErrors, the one exception
    dynamo re-raises from a fake as it is (torch 2.13, ``torch._dynamo.utils.run_node``); any other
    it wraps in a TorchRuntimeError or a graph break whose text buries tmoe's message in a repr of
    every argument. So the user's traceback ends in tmoe's message. Outside tracing (eager, a
    direct op call) the errors pass unchanged."""

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (TypeError, ValueError, NotImplementedError) as err:
            if isinstance(err, IndexError) or torch._guards.TracingContext.try_get() is None:
                raise
            compiled = next(c for base, c in _COMPILED if isinstance(err, base))
            raise compiled(*err.args).with_traceback(err.__traceback__) from None

    return checked  # type: ignore[return-value]
