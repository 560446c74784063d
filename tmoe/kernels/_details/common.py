"""Jit helpers shared by the stage kernels: activations, W1's column blocks, expert ids through
the expert map, fp8 rounding, block-fp8 weight tiles."""
import triton
import triton.language as tl


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


# The activations are written once for both dialects (builtins only, no jit helper calls): jitted
# here for the tl kernels and by ``ws_engine`` for the Gluon engine, so both apply the same math.
def _act_and_mul(gate, up, alpha, limit, ACTIVATION: tl.constexpr, CLAMP: tl.constexpr):
    """``act(gate) * up`` in float32; gate and up are [BM, BN] float32 tiles; ``alpha`` and
    ``limit`` runtime floats. CLAMP with silu: min(silu(gate), limit) * clamp(up, -limit, limit)."""
    if ACTIVATION == "silu":
        out = gate * (1.0 / (1.0 + tl.exp(-gate)))
        if CLAMP:
            out = tl.minimum(out, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        out = out * up
    elif ACTIVATION == "gelu":
        out = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476)) * up
    elif ACTIVATION == "gelu_tanh":
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        out = 0.5 * gate * (1.0 + (2.0 * (1.0 / (1.0 + tl.exp(-2.0 * inner))) - 1.0)) * up
    else:  # swigluoai (GPT-OSS): gate <= limit, up in [-limit, limit], gate * sigmoid(alpha * gate) * (up + 1)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        out = gate * (1.0 / (1.0 + tl.exp(-(alpha * gate)))) * (up + 1.0)
    return out


def _act_no_mul(h, ACTIVATION: tl.constexpr):
    """``act(h)`` in float32 for the non-gated activations; h is a [BM, BN] float32 tile."""
    if ACTIVATION == "silu_no_mul":
        out = h * (1.0 / (1.0 + tl.exp(-h)))
    elif ACTIVATION == "gelu_no_mul":
        out = 0.5 * h * (1.0 + tl.erf(h * 0.7071067811865476))
    else:  # relu2_no_mul: relu(h)^2
        r = tl.maximum(h, 0.0)
        out = r * r
    return out


act_and_mul = triton.jit(_act_and_mul)
act_no_mul = triton.jit(_act_no_mul)


@triton.jit
def w1_columns(pid_n, N, BLOCK_N: tl.constexpr, MUL: tl.constexpr, INTERLEAVED: tl.constexpr,
               HALVES: tl.constexpr = False):
    """(W1 rows [BN] int64, their mask) of up-GEMM column block ``pid_n``; MUL: [2BN], tile column
    2j the gate row of n_j, 2j + 1 its up row (N + n_j; INTERLEAVED: W1 rows 2 n_j and 2 n_j + 1);
    HALVES (gate rows then up rows, W1 stored transposed): tile column j the gate row of n_j, BN + j
    its up row, so each half is a contiguous run of W1's contiguous dimension."""
    if MUL:
        offs_c = tl.arange(0, 2 * BLOCK_N)
        if INTERLEAVED:
            w_cols = pid_n.to(tl.int64) * 2 * BLOCK_N + offs_c  # [2BN]
            mask_c = (pid_n * BLOCK_N + offs_c // 2) < N
        elif HALVES:
            w_cols = (offs_c // BLOCK_N) * N + pid_n.to(tl.int64) * BLOCK_N + offs_c % BLOCK_N  # [2BN]
            mask_c = (pid_n * BLOCK_N + offs_c % BLOCK_N) < N
        else:
            w_cols = (offs_c % 2) * N + pid_n.to(tl.int64) * BLOCK_N + offs_c // 2  # [2BN]
            mask_c = (pid_n * BLOCK_N + offs_c // 2) < N
    else:
        w_cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        mask_c = w_cols < N
    return w_cols, mask_c


@triton.jit
def split_gate_up(acc, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, HALVES: tl.constexpr):
    """(gate, up) [ROWS, BN] of an up-GEMM tile [ROWS, 2BN] whose columns are in ``w1_columns``' order."""
    if HALVES:
        return tl.split(tl.permute(tl.reshape(acc, (ROWS, 2, BLOCK_N)), (0, 2, 1)))
    return tl.split(tl.reshape(acc, (ROWS, BLOCK_N, 2)))


@triton.jit
def local_expert(topk_ids_ptr, expert_map_ptr, slot, num_experts, num_local_experts, HAS_MAP: tl.constexpr,
                 mask=None):
    """The local expert (int64) of ``slot`` (a scalar or a vector of slots, ``mask`` marking the
    real ones): topk_ids[slot], mapped through expert_map when HAS_MAP; -1 when the id is
    outside [0, num_experts), the mapped id outside [0, num_local_experts) (remote, or a bad
    map entry), or the slot is masked."""
    if mask is None:
        expert = tl.load(topk_ids_ptr + slot).to(tl.int64)
    else:
        expert = tl.load(topk_ids_ptr + slot, mask=mask, other=-1).to(tl.int64)
    valid = (expert >= 0) & (expert < num_experts)
    if HAS_MAP:
        expert = tl.load(expert_map_ptr + expert, mask=valid, other=-1).to(tl.int64)
        valid &= (expert >= 0) & (expert < num_local_experts)
    return tl.where(valid, expert, -1)


@triton.jit
def abs_no_nan(x):
    """|x| with NaN -> 0, so a NaN element does not set its group's scale."""
    return tl.where(x != x, 0.0, tl.abs(x))


@triton.jit
def fp8_scale(absmax, eps, FP8_MAX: tl.constexpr, USE_UE8M0: tl.constexpr):
    """max(absmax, eps) / FP8_MAX (IEEE); USE_UE8M0: rounded up to a power of two on the exponent bits."""
    absmax = tl.maximum(absmax, eps)
    scale = tl.div_rn(absmax, tl.full(absmax.shape, FP8_MAX, tl.float32))
    if USE_UE8M0:
        bits = scale.to(tl.int32, bitcast=True)
        carry = tl.where((bits & 0x7FFFFF) != 0, 0x800000, 0)
        scale = ((bits & 0x7F800000) + carry).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def to_fp8(x, scale, FP8_MAX: tl.constexpr):
    """clamp(x / scale, ±FP8_MAX) in float32, x and scale of one shape; NaN stays NaN."""
    q = tl.div_rn(x, scale)
    return tl.where(q != q, q, tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX))


@triton.jit
def dequant_block(q, scale_ptr, rows, cols, stride_sr, stride_sc, mask, SCALE_R: tl.constexpr,
                  SCALE_C: tl.constexpr, dtype: tl.constexpr):
    """A tile of block-fp8 weights in ``dtype``: q times the scale of its (SCALE_R x SCALE_C) block,
    ``rows``/``cols`` the tile's element indices along the weight's rows and columns (broadcast)."""
    s = tl.load(scale_ptr + (rows // SCALE_R) * stride_sr + (cols // SCALE_C) * stride_sc, mask=mask, other=0.0)
    return (q.to(tl.float32) * s).to(dtype)
