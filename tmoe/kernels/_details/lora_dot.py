"""Jit helper: the LoRA term of an expert GEMM's output tile, added in its epilogue.

For a tile of rows (slots) of expert e and output columns ``cols`` of the expert's weight W[e]
(C_out, C_in), the low-rank update of W[e] is ``scale * B[e] @ A[e]`` (B (C_out, r), A (r, C_in)).
The GEMM's K loop ran over W[e] alone; the epilogue adds ``scale * u @ L[e][:, cols]``, where the
rows' ``u`` (r values each) is their product with the other factor, computed beforehand by a small
GEMM of its own: never W[e] + B[e] A[e]. One [BM, R] x [R, BN] dot (R the rank padded to a power
of two, at least 16) accumulating onto the tile's float32 accumulator.

Serving several adapters (``lora_term_adapters``): each row has its adapter (or -1, none), L[e] is
then one of the stacked factors L[l, e], and the tile adds, adapter by adapter, the dot of the rows
of that adapter (the others masked to zero, so they add exactly 0); an adapter no row of the tile
uses is skipped, so a tile reads only the factors its rows use."""
import triton
import triton.language as tl


@triton.jit
def lora_term(
    acc,  # [BM, BN] float32 tile of the GEMM
    u_rows,  # [BM] int64 pointers to the rows' first u value (u [rows, rank], x's dtype)
    mask_m,  # [BM] valid rows
    l_ptr,  # this expert's factor L[e]: element (j, c) at l_ptr + j * stride_lr + c * stride_lc
    cols,  # [BN] int64 output columns of the tile in L's column space
    mask_n,  # [BN] valid columns
    rank, stride_lr, stride_lc, scale,
    LORA_R: tl.constexpr, PRECISION: tl.constexpr,
):
    """acc + (scale * u[rows, :rank]) @ L[:rank, cols] (float32 [BM, BN]; scale * u rounded to u's
    dtype, exact for a power-of-two scale); masked rows and columns add 0."""
    offs_r = tl.arange(0, LORA_R)
    mask_r = offs_r < rank
    u = tl.load(u_rows[:, None] + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :], other=0.0)  # [BM, R]
    lt = tl.load(l_ptr + offs_r[:, None] * stride_lr + cols[None, :] * stride_lc,
                 mask=mask_r[:, None] & mask_n[None, :], other=0.0)  # [R, BN]
    # the MMA accumulates onto the tile in place: a separate [BM, BN] product beside acc spills registers
    # at the grouped core's 128 x 256 tiles (STACK 592 bytes on sm_90)
    # scale * u in float32, then rounded (a half-precision u times the scale promotes to float32 on a GPU
    # too; the interpreter takes a float scale as a constant of u's dtype, which it cannot build for bf16)
    return tl.dot((u.to(tl.float32) * scale).to(u.dtype), lt, acc, input_precision=PRECISION)


@triton.jit
def lora_term_adapters(
    acc,  # [BM, BN] float32 tile of the GEMM
    u_rows,  # [BM] int64 pointers to the rows' first u value (u [rows, rank]: the row's adapter's)
    adapters,  # [BM] int32 each row's adapter, -1 for none
    mask_m,  # [BM] valid rows
    l_ptr,  # this expert's stacked factors: element (j, c) of adapter l at l_ptr + l * stride_ll + ...
    cols,  # [BN] int64 output columns of the tile in L's column space
    mask_n,  # [BN] valid columns
    rank, num_adapters, stride_ll, stride_lr, stride_lc, scale,
    LORA_R: tl.constexpr, PRECISION: tl.constexpr,
):
    """acc + sum over adapters l of (scale * u[rows of l]) @ L[l][:rank, cols], in adapter order;
    rows of no adapter (-1) and masked rows add 0."""
    for adapter in range(num_adapters):
        rows = mask_m & (adapters == adapter)  # [BM]
        if tl.max(rows.to(tl.int32), axis=0) > 0:
            acc = lora_term(acc, u_rows, rows, l_ptr + tl.cast(adapter, tl.int64) * stride_ll, cols, mask_n, rank,
                            stride_lr, stride_lc, scale, LORA_R, PRECISION)
    return acc
