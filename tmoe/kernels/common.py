"""Jit helpers shared by the stage kernels: activations, tile ordering, the MoE tile matmuls
(pointer loads, and TMA loads of the weights), fp8 rounding."""
import triton
import triton.language as tl

from tmoe.kernels.dequant import b_rows, dequant_dot, oriented_dot

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


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def act_and_mul(gate, up, alpha, limit, ACTIVATION: tl.constexpr, CLAMP: tl.constexpr):
    """``act(gate) * up`` in float32; gate and up are [BM, BN] float32 tiles; ``alpha`` and
    ``limit`` runtime floats. CLAMP with silu: min(silu(gate), limit) * clamp(up, -limit, limit)."""
    if ACTIVATION == "silu":
        out = gate * _sigmoid(gate)
        if CLAMP:
            out = tl.minimum(out, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        out = out * up
    elif ACTIVATION == "gelu":
        out = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476)) * up
    elif ACTIVATION == "gelu_tanh":
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        out = 0.5 * gate * (1.0 + (2.0 * _sigmoid(2.0 * inner) - 1.0)) * up
    else:  # swigluoai (GPT-OSS): gate <= limit, up in [-limit, limit], gate * sigmoid(alpha * gate) * (up + 1)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        out = gate * _sigmoid(alpha * gate) * (up + 1.0)
    return out


@triton.jit
def act_no_mul(h, ACTIVATION: tl.constexpr):
    """``act(h)`` in float32 for the non-gated activations; h is a [BM, BN] float32 tile."""
    if ACTIVATION == "silu_no_mul":
        out = h * _sigmoid(h)
    elif ACTIVATION == "gelu_no_mul":
        out = 0.5 * h * (1.0 + tl.erf(h * 0.7071067811865476))
    else:  # relu2_no_mul: relu(h)^2
        r = tl.maximum(h, 0.0)
        out = r * r
    return out


@triton.jit
def w1_columns(pid_n, N, BLOCK_N: tl.constexpr, MUL: tl.constexpr, INTERLEAVED: tl.constexpr):
    """(W1 rows [BN] int64, their mask) of up-GEMM column block ``pid_n``; MUL: [2BN], tile column
    2j the gate row of n_j, 2j + 1 its up row (N + n_j; INTERLEAVED: W1 rows 2 n_j and 2 n_j + 1)."""
    if MUL:
        offs_c = tl.arange(0, 2 * BLOCK_N)
        if INTERLEAVED:
            w_cols = pid_n.to(tl.int64) * 2 * BLOCK_N + offs_c  # [2BN]
        else:
            w_cols = (offs_c % 2) * N + pid_n.to(tl.int64) * BLOCK_N + offs_c // 2  # [2BN]
        mask_c = (pid_n * BLOCK_N + offs_c // 2) < N
    else:
        w_cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        mask_c = w_cols < N
    return w_cols, mask_c


@triton.jit
def tile_ids(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped (swizzled) order of output tiles: GROUP_M row-blocks share each column sweep."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


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
def moe_tile_matmul(
    a_ptrs,  # [BM, BK] pointers at k = 0
    b_ptrs,  # [BK, BN] pointers at k = 0 (4-bit: [BK/2, BN] packed bytes)
    mask_m,  # [BM] valid rows
    mask_n,  # [BN] valid columns
    a_scale_ptrs,  # [BM] pointers to per-row (or per-row-group) activation scales
    b_scale_ptrs,  # [BN] pointers to per-column (or per-column-group) weight scales
    zp_ptrs,  # [BN] pointers to the columns' zero points (low-bit, HAS_ZP)
    zp_shift,  # [BN] nibble shift of each column's zero point (int4)
    K,
    stride_ak,
    stride_bk,
    stride_ask,
    stride_bsk,
    stride_zpk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_K: tl.constexpr,
    QUANT: tl.constexpr,
    HAS_ZP: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    ASM_UNPACK: tl.constexpr,
    SWAP_AB: tl.constexpr,
):
    """float32 [BM, BN] = A[rows, :K] @ B[:K, cols], dequantized.

    QUANT: "none"; "scaled" (one scale per row of A and per column of B, broadcast by
    zero strides for per-tensor scales, applied once at the end); "block" (scales per
    GROUP_K slice of K, applied per K tile; GROUP_K is a multiple of BLOCK_K); weight-only
    "int4", "int8", "mxfp4" (B holds codes, 4-bit: [BK/2, BN] packed bytes, two k per byte; one
    scale and zero point per column and GROUP_K slice of K; ``dequant.dequant_dot``).
    SWAP_AB: the K loop accumulates the transposed tile, B^T @ A^T [BN, BM] (B the MMA's LHS, as
    loaded or dequantized), transposed once after the loop.
    """
    offs_k = tl.arange(0, BLOCK_K)
    _, b_k = b_rows(BLOCK_K, QUANT)  # [BK] logical k of B's rows ([BK/2] 4-bit)
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(b_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        if QUANT == "block":
            k_group = (k * BLOCK_K) // GROUP_K
            a_s = tl.load(a_scale_ptrs + k_group * stride_ask, mask=mask_m, other=0.0)
            b_s = tl.load(b_scale_ptrs + k_group * stride_bsk, mask=mask_n, other=0.0)
            part = oriented_dot(a, b, None, SWAP_AB, PRECISION)  # [BM, BN] ([BN, BM])
            if SWAP_AB:
                acc += part * b_s[:, None] * a_s[None, :]
            else:
                acc += part * a_s[:, None] * b_s[None, :]
        elif QUANT == "none" or QUANT == "scaled":
            acc = oriented_dot(a, b, acc, SWAP_AB, PRECISION)
        else:  # low-bit weights
            acc = dequant_dot(a, b, acc, b_scale_ptrs, zp_ptrs, zp_shift, k * BLOCK_K, K, stride_bsk, stride_zpk,
                              mask_n, BLOCK_K, GROUP_K, QUANT, HAS_ZP, PRECISION, ASM_UNPACK,
                              SWAP_AB)  # [BM, BN] ([BN, BM])
        a_ptrs += BLOCK_K * stride_ak
        if QUANT == "int4" or QUANT == "mxfp4":
            b_ptrs += (BLOCK_K // 2) * stride_bk
        else:
            b_ptrs += BLOCK_K * stride_bk
    if SWAP_AB:
        acc = tl.trans(acc)  # [BM, BN]
    if QUANT == "scaled":
        a_s = tl.load(a_scale_ptrs, mask=mask_m, other=0.0)
        b_s = tl.load(b_scale_ptrs, mask=mask_n, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
    return acc


@triton.jit
def moe_tile_matmul_tma(
    a_ptrs,  # [BM, BK] pointers at k = 0
    w_desc,  # TMA descriptor of W [E, N_w, K], block [1, BN, BK]; rows or K past the end read zero
    mask_m,  # [BM] valid rows
    expert,  # int32 expert index of W
    col_0,  # first W row of the first tile
    col_1,  # first W row of the second tile (TWO_TILES)
    n_w,  # rows of W per expert
    a_scale_ptrs,  # [BM] pointers to per-row (or per-row-group) activation scales
    w_scale_ptr,  # this expert's weight scales
    K,
    stride_ak,
    stride_ask,
    stride_wsn,
    stride_wsk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    QUANT: tl.constexpr,
    TWO_TILES: tl.constexpr,
    UNIFORM_W_SCALE: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """float32 ([BM, BN], [BM, BN]) = A[rows, :K] @ W[expert, col:col + BN, :K]^T for col = col_0
    and, TWO_TILES (the gate and up halves of W1), col_1; W is read by TMA, A by pointers.
    Dequantized as moe_tile_matmul; UNIFORM_W_SCALE (block quantization, each tile inside one
    GROUP_N group of W rows) loads one weight scale per tile and K group."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_bn = tl.arange(0, BLOCK_N)
    acc_0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rows_0 = col_0 + offs_bn  # [BN]
    rows_1 = col_1 + offs_bn
    if UNIFORM_W_SCALE:
        ws_0 = w_scale_ptr + (col_0 // GROUP_N) * stride_wsn
        ws_1 = w_scale_ptr + (col_1 // GROUP_N) * stride_wsn
    else:
        ws_0 = w_scale_ptr + (rows_0 // GROUP_N) * stride_wsn  # [BN]
        ws_1 = w_scale_ptr + (rows_1 // GROUP_N) * stride_wsn
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < K - k * BLOCK_K), other=0.0)
        b_0 = w_desc.load([expert, col_0, k * BLOCK_K]).reshape(BLOCK_N, BLOCK_K).T  # [BK, BN]
        if TWO_TILES:
            b_1 = w_desc.load([expert, col_1, k * BLOCK_K]).reshape(BLOCK_N, BLOCK_K).T
        if QUANT == "block":
            k_group = (k * BLOCK_K) // GROUP_K
            a_s = tl.load(a_scale_ptrs + k_group * stride_ask, mask=mask_m, other=0.0)  # [BM]
            if UNIFORM_W_SCALE:
                acc_0 += tl.dot(a, b_0, input_precision=PRECISION) * (a_s * tl.load(ws_0 + k_group * stride_wsk))[:, None]
                if TWO_TILES:
                    acc_1 += tl.dot(a, b_1, input_precision=PRECISION) * (a_s * tl.load(ws_1 + k_group * stride_wsk))[:, None]
            else:
                s_0 = tl.load(ws_0 + k_group * stride_wsk, mask=rows_0 < n_w, other=0.0)
                acc_0 += tl.dot(a, b_0, input_precision=PRECISION) * a_s[:, None] * s_0[None, :]
                if TWO_TILES:
                    s_1 = tl.load(ws_1 + k_group * stride_wsk, mask=rows_1 < n_w, other=0.0)
                    acc_1 += tl.dot(a, b_1, input_precision=PRECISION) * a_s[:, None] * s_1[None, :]
        else:
            acc_0 = tl.dot(a, b_0, acc_0, input_precision=PRECISION)
            if TWO_TILES:
                acc_1 = tl.dot(a, b_1, acc_1, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
    if QUANT == "scaled":
        a_s = tl.load(a_scale_ptrs, mask=mask_m, other=0.0)
        acc_0 = acc_0 * a_s[:, None] * tl.load(w_scale_ptr + rows_0 * stride_wsn, mask=rows_0 < n_w, other=0.0)[None, :]
        if TWO_TILES:
            acc_1 = acc_1 * a_s[:, None] * tl.load(w_scale_ptr + rows_1 * stride_wsn, mask=rows_1 < n_w, other=0.0)[None, :]
    return acc_0, acc_1


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


def cdiv(a: int, b: int) -> int:
    """Host-side ceil(a / b); ``triton.cdiv`` is a constexpr function, slow to call from Python."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Host-side smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def check_num_local_experts(num_local_experts: int | None, expert_map: object, num_experts: int) -> int:
    """The bound on mapped expert ids: ``num_local_experts`` when given; else ``num_experts``
    (vLLM's contract, which passes none: a map holds local ids below it, and reading the true
    count from the map would sync). Without a map, ids are local ids and the bound is ``num_experts``."""
    if expert_map is None or num_local_experts is None:
        return num_experts
    if isinstance(num_local_experts, bool) or not isinstance(num_local_experts, int) or num_local_experts < 0:
        raise ValueError(f"num_local_experts must be a non-negative int, got {num_local_experts!r}")
    return num_local_experts
