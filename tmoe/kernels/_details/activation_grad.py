"""Jit helpers of the backward: each activation's value and derivative, in float32."""
import triton
import triton.language as tl

from tmoe.kernels._details.common import _sigmoid


@triton.jit
def _silu_grad(x):
    """(silu(x), silu'(x)) in float32."""
    s = _sigmoid(x)
    return x * s, s * (1.0 + x * (1.0 - s))


@triton.jit
def _gelu_grad(x, TANH: tl.constexpr):
    """(gelu(x), gelu'(x)) in float32 (TANH: the tanh approximation)."""
    if TANH:
        t = 2.0 * _sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x)) - 1.0  # tanh(sqrt(2/pi) (x + ...))
        dt = 0.7978845608028654 * (1.0 + 0.134145 * x * x)  # d/dx of the tanh's argument
        return 0.5 * x * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dt
    cdf = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))
    return x * cdf, cdf + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)


@triton.jit
def act_and_mul_grad(gate, up, alpha, limit, ACTIVATION: tl.constexpr, CLAMP: tl.constexpr):
    """(a, da/dgate, da/dup) of ``common.act_and_mul``; [BM, BN] float32 tiles. Clamps pass the
    gradient where the input lies inside the closed range, as torch.clamp does."""
    if ACTIVATION == "swigluoai":
        in_g = gate <= limit
        in_u = (up >= -limit) & (up <= limit)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        s = _sigmoid(alpha * gate)
        glu = gate * s
        d_gate = tl.where(in_g, (s + glu * alpha * (1.0 - s)) * (up + 1.0), 0.0)
        return glu * (up + 1.0), d_gate, tl.where(in_u, glu, 0.0)
    if ACTIVATION == "silu":
        f, df = _silu_grad(gate)
    else:
        f, df = _gelu_grad(gate, ACTIVATION == "gelu_tanh")
    if CLAMP:  # silu with a limit: min(silu(gate), limit) * clamp(up, -limit, limit)
        df = tl.where(f <= limit, df, 0.0)
        f = tl.minimum(f, limit)
        d_up = tl.where((up >= -limit) & (up <= limit), f, 0.0)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    else:
        d_up = f
    return f * up, df * up, d_up


@triton.jit
def act_no_mul_grad(h, ACTIVATION: tl.constexpr):
    """(act(h), act'(h)) of ``common.act_no_mul``; [BM, BN] float32 tile."""
    if ACTIVATION == "silu_no_mul":
        f, df = _silu_grad(h)
    elif ACTIVATION == "gelu_no_mul":
        f, df = _gelu_grad(h, False)
    else:  # relu2_no_mul
        r = tl.maximum(h, 0.0)
        f, df = r * r, 2.0 * r
    return f, df
