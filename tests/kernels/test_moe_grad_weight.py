"""The weight-gradient GEMM (``moe_grad_weight``) alone, on both of its paths (token rows copied
into aligned order and loaded by TMA; token rows gathered by pointers), against a float64 sum
over the slots: tokens on either side, router weights on the token rows, remote experts, ids out
of range and skew. Aligned rows the kernel must not read (past the padded length, remote experts')
hold NaN."""
import pytest
import torch

import tmoe.kernels.moe_grad_weight as grad_weight_module
from tmoe.kernels.align import moe_align_block_size
from tmoe.kernels.grad_config import WeightTiles
from tmoe.kernels.moe_grad_weight import moe_grad_weight, sorted_operands_fit
from tmoe.testing import assert_close
from tmoe.testing.strategies import MoEShape, half_remote_expert_map, make_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TILES = {"tma": WeightTiles(32, 32, 32, 4, 2), "tma-wide": WeightTiles(32, 64, 32, 4, 2),
         "pointer": WeightTiles(32, 32, 32, 4, 2, tma=False)}


def _problem(m: int, e: int, p_dim: int, q_dim: int, topk: int, routing: str, block_m: int, remote: bool,
             dtype: torch.dtype):
    """(tokens (M, D_t), aligned (P, D_a), topk_weights, topk_ids, sorted_ids, offsets, expert_map, local ids)."""
    p = make_problem(MoEShape(m, e, 8, 8, topk), dtype, routing, seed=m + e, device=DEVICE)
    g = torch.Generator().manual_seed(m)
    expert_map = half_remote_expert_map(e, DEVICE) if remote else None
    offsets = torch.empty(e + 1, dtype=torch.int32, device=DEVICE)
    sorted_ids, expert_ids, _ = moe_align_block_size(p.topk_ids, block_m, e, expert_map, offsets,
                                                     num_local_experts=(e + 1) // 2 if remote else None)
    tokens = torch.randn(m, p_dim, generator=g).to(dtype).to(DEVICE)
    aligned = torch.full((sorted_ids.shape[0], q_dim), float("nan"), dtype=dtype, device=DEVICE)
    slots = sorted_ids.long()
    rows = torch.arange(sorted_ids.shape[0], device=DEVICE)
    expert_of_row = expert_ids.long().repeat_interleave(block_m)[: sorted_ids.shape[0]]
    written = (rows < offsets[-1].long()) & (expert_of_row >= 0)  # what moe_grad_act writes: local experts' runs
    values = torch.randn(sorted_ids.shape[0], q_dim, generator=g).to(dtype).to(DEVICE)
    aligned[written] = torch.where((slots < m * topk)[:, None], values, 0.0)[written]  # padding rows zero
    local = expert_map.long()[p.topk_ids.long().clamp(0, e - 1)] if remote else p.topk_ids.long()
    local = torch.where((p.topk_ids >= 0) & (p.topk_ids < e), local, -1)
    return tokens, aligned, p.topk_weights, sorted_ids, offsets, expert_map, local


def _reference(tokens, aligned, topk_weights, sorted_ids, local, e_local, tokens_left, scale_tokens):
    """dW[e] = sum over slots s of expert e of L_s^T R_s in float64."""
    m, topk = topk_weights.shape
    row_of_slot = torch.full((m * topk,), -1, dtype=torch.long)
    valid = sorted_ids.cpu().long() < m * topk
    row_of_slot[sorted_ids.cpu().long()[valid]] = torch.arange(sorted_ids.shape[0])[valid]
    t = tokens.cpu().double()
    a = aligned.cpu().double()
    w = topk_weights.cpu().double().flatten()
    out = torch.zeros(e_local, *((tokens.shape[1], aligned.shape[1]) if tokens_left else
                                 (aligned.shape[1], tokens.shape[1])), dtype=torch.float64)
    for s, e in enumerate(local.cpu().flatten().tolist()):
        if e < 0:
            continue
        tok = t[s // topk] * (w[s] if scale_tokens else 1.0)
        r = a[row_of_slot[s]]
        out[e] += torch.outer(tok, r) if tokens_left else torch.outer(r, tok)
    return out


@pytest.mark.parametrize("path", list(TILES))
@pytest.mark.parametrize("tokens_left, scale_tokens", [(True, False), (False, False), (False, True)])
@pytest.mark.parametrize("m, e, routing, remote", [
    (37, 4, "skewed", False), (23, 6, "out_of_range", False), (29, 6, "uniform", True), (1, 4, "uniform", False),
], ids=str)
def test_weight_gradient_matches_float64(path, tokens_left, scale_tokens, m, e, routing, remote, monkeypatch):
    p_dim, q_dim, topk, block_m = 48, 40, 2, 64
    tokens, aligned, tw, sorted_ids, offsets, emap, local = _problem(m, e, p_dim, q_dim, topk, routing, block_m,
                                                                     remote, torch.float32)
    e_local = (e + 1) // 2 if remote else e
    launched = []
    launch = grad_weight_module.launch
    monkeypatch.setattr(grad_weight_module, "launch", lambda k, *a, **kw: (launched.append(k.fn.__name__),
                                                                           launch(k, *a, **kw))[1])
    left, right = (tokens, aligned) if tokens_left else (aligned, tokens)
    out = moe_grad_weight(left, right, tw, sorted_ids, offsets, e_local, tokens_left=tokens_left,
                          scale_tokens=scale_tokens, row_align=block_m, expert_map=emap, tiles=TILES[path])
    kernel = "_moe_grad_weight_kernel" if path == "pointer" else "_moe_grad_weight_tma_kernel"
    assert launched[-1] == kernel, launched
    assert not out.isnan().any()
    ref = _reference(tokens, aligned, tw, sorted_ids, local, e_local, tokens_left, scale_tokens)
    assert_close(out, ref.to(out.device), torch.float32, name="dW")


def test_tma_path_needs_whole_row_blocks_and_16_byte_rows():
    """Row blocks must tile each expert's run (block_r divides the align block) and every row
    must be a 16-byte multiple; otherwise the pointer kernel runs."""
    a, b = torch.empty(4, 40), torch.empty(4, 48)
    tiles = WeightTiles(block_r=64)
    assert sorted_operands_fit(a, b, 64, tiles) and sorted_operands_fit(a, b, 128, tiles)
    assert not sorted_operands_fit(a, b, 32, tiles)  # runs of 32 rows: a 64-row block would cross experts
    assert not sorted_operands_fit(a, torch.empty(4, 50), 64, tiles)  # 200-byte rows
    assert not sorted_operands_fit(a, b, 64, WeightTiles(tma=False))


def test_scaled_token_rows_round_once_as_on_the_pointer_path():
    """bf16 token rows times router weights: the TMA path's sorted copy rounds w * x once, as the
    pointer kernel rounds it in registers: the paths agree to float32 rounding (rounding the product
    twice, or not at all, would differ at bf16's)."""
    tokens, aligned, tw, sorted_ids, offsets, _, _ = _problem(41, 4, 64, 32, 2, "skewed", 64, False, torch.bfloat16)
    outs = [moe_grad_weight(aligned, tokens, tw, sorted_ids, offsets, 4, tokens_left=False, scale_tokens=True,
                            row_align=64, tiles=TILES[path]) for path in ("tma", "pointer")]
    assert_close(outs[0], outs[1], torch.float32, name="dW1 (TMA vs pointer)")
