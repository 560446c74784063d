"""Host-side size arithmetic of the launchers, and the bound on mapped expert ids."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Host-side ceil(a / b); ``triton.cdiv`` is a constexpr function, slow to call from Python."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Host-side smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


L2_ROWS_BUDGET = 24 << 20  # bytes of row operands one tile group keeps in L2 (half of Hopper's 50 MB)


def row_group(row_block_bytes: int, max_group: int = 32) -> int:
    """Row blocks that sweep every column block together (grouped tile order, ``tile_ids``): as many
    as keep their row operands within L2_ROWS_BUDGET, at most ``max_group``, at least 1. In row-major
    order each column block re-reads every row from memory (GPT-OSS-20B's dX GEMM: 17 GB a step)."""
    return max(1, min(max_group, L2_ROWS_BUDGET // max(row_block_bytes, 1)))


def backward_stages(num_stages: int, fp32: bool, fp8_weights: bool = False) -> int:
    """Pipeline stages of a backward GEMM: at most two where a K step's tiles are large, float32
    operands (twice bf16's bytes) or frozen fp8 weights (each step also stages a gathered float32
    block scale per weight: 240-295 KB at 3-4 stages on sm_90, over its 227 KB; 100-172 KB at 2)."""
    return min(num_stages, 2) if fp32 or fp8_weights else num_stages


def check_num_local_experts(num_local_experts: int | None, expert_map: object, num_experts: int) -> int:
    """The bound on mapped expert ids: ``num_local_experts`` when given; else ``num_experts``
    (vLLM's contract, which passes none: a map holds local ids below it, and reading the true
    count from the map would sync). Without a map, ids are local ids and the bound is ``num_experts``."""
    if expert_map is None or num_local_experts is None:
        return num_experts
    if isinstance(num_local_experts, bool) or not isinstance(num_local_experts, int) or num_local_experts < 0:
        raise ValueError(f"num_local_experts must be a non-negative int, got {num_local_experts!r}")
    return num_local_experts
