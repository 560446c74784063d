"""The activations the expert GEMMs apply, as the host sees them: names, W1's rows per
intermediate column, and the runtime parameters the kernels take."""
from __future__ import annotations

GATED_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai")  # act(gate) * up: W1 has 2N rows
NO_MUL_ACTIVATIONS = ("silu_no_mul", "gelu_no_mul", "relu2_no_mul")  # act(h): W1 has N rows
ACTIVATIONS = GATED_ACTIVATIONS + NO_MUL_ACTIVATIONS
SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT = 1.702, 7.0  # GPT-OSS's defaults


def w1_rows_per_n(activation: str) -> int:
    """Rows of W1 per intermediate column: 2 (gate and up) for a gated activation, 1 for *_no_mul."""
    return 1 if activation in NO_MUL_ACTIVATIONS else 2


def activation_params(activation: str, alpha: float | None, limit: float | None) -> tuple[float, float, bool]:
    """(alpha, limit, clamp) as the kernels take them: the runtime floats (swigluoai's default
    1.702 and 7.0 for None) and whether the epilogue clamps (swigluoai always; silu with a limit)."""
    if activation == "swigluoai":
        return (SWIGLUOAI_ALPHA if alpha is None else float(alpha),
                SWIGLUOAI_LIMIT if limit is None else float(limit), True)
    return 1.0, 0.0 if limit is None else float(limit), limit is not None
