"""The activations the expert GEMMs apply, as the host sees them: names, W1's rows per
intermediate column, and ``Activation``, the one value that carries a call's activation and its
options from the op to the kernels' arguments."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

MUL_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai")  # act(gate) * up: W1 has 2N rows
NO_MUL_ACTIVATIONS = ("silu_no_mul", "gelu_no_mul", "relu2_no_mul")  # act(h): W1 has N rows
ACTIVATIONS = MUL_ACTIVATIONS + NO_MUL_ACTIVATIONS
SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT = 1.702, 7.0  # GPT-OSS's defaults


@dataclass(frozen=True)
class Activation:
    """A call's activation, decided once (checked by ``tmoe.modular.checks.check_activation``).

    ``name`` one of ``ACTIVATIONS``; ``alpha`` swigluoai's (None: 1.702); ``limit`` swigluoai's
    (None: 7.0) or the clamped silu's (None: no clamp); ``interleaved``: w1's rows alternate gate
    and up (row 2j gate j, row 2j + 1 up j) instead of gate rows then up rows. A launch plan keys
    on it as one value; alpha and limit reach the kernels as runtime floats (no recompile)."""

    PLAN_AS_VALUE: ClassVar[bool] = True
    name: str = "silu"
    alpha: float | None = None
    limit: float | None = None
    interleaved: bool = False

    @property
    def mul(self) -> bool:
        """act(gate) * up (W1 has gate and up rows: the kernels' ``MUL``), as opposed to a *_no_mul
        act(h). (In a GEMM launcher, ``gated`` names the up GEMM, the one with an activation.)"""
        return self.name not in NO_MUL_ACTIVATIONS

    @property
    def rows_per_n(self) -> int:
        """Rows of W1 per intermediate column: 2 for act(gate) * up, 1 for *_no_mul."""
        return 2 if self.mul else 1

    def intermediate_size(self, w1_rows: int) -> int:
        """N from W1's row count (``w1.shape[1]``): read once per layer call, by ``check_layer_call``."""
        return w1_rows // self.rows_per_n

    def as_args(self) -> tuple[str, float | None, float | None, bool]:
        """(activation, swiglu_alpha, swiglu_limit, gate_up_interleaved): the schema arguments of an op
        that takes this value (``from_args`` rebuilds it)."""
        return self.name, self.alpha, self.limit, self.interleaved

    @classmethod
    def from_args(cls, activation: str, swiglu_alpha: float | None, swiglu_limit: float | None,
                  gate_up_interleaved: bool) -> Activation:
        """The value an op's schema arguments (``LayerArgs``' names) stand for."""
        return cls(activation, swiglu_alpha, swiglu_limit, gate_up_interleaved)

    def layer_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``tmoe.fused_experts`` this value stands for (``LayerArgs``'s names)."""
        return dict(activation=self.name, swiglu_alpha=self.alpha, swiglu_limit=self.limit,
                    gate_up_interleaved=self.interleaved)

    def floats(self) -> tuple[float, float, bool]:
        """(alpha, limit, clamp) as the kernels take them: the runtime floats (swigluoai's defaults
        for None) and whether the epilogue clamps (swigluoai always; silu with a limit)."""
        if self.name == "swigluoai":
            return (SWIGLUOAI_ALPHA if self.alpha is None else float(self.alpha),
                    SWIGLUOAI_LIMIT if self.limit is None else float(self.limit), True)
        return 1.0, 0.0 if self.limit is None else float(self.limit), self.limit is not None

    def kernel_args(self) -> dict[str, Any]:
        """The up GEMM's activation arguments: ACTIVATION, MUL, INTERLEAVED, CLAMP (constexprs) and
        act_alpha, act_limit (runtime floats)."""
        alpha, limit, clamp = self.floats()
        return dict(ACTIVATION=self.name, MUL=self.mul, INTERLEAVED=self.mul and self.interleaved, CLAMP=clamp,
                    act_alpha=alpha, act_limit=limit)


NO_ACTIVATION_ARGS = dict(ACTIVATION="silu", MUL=False, INTERLEAVED=False, CLAMP=False, act_alpha=1.0, act_limit=0.0)
"""``kernel_args`` of a GEMM without an activation (the down GEMM; the constexprs are ignored)."""
