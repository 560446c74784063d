"""Kernels take token counts as plain ints (``do_not_specialize``), so a new M never compiles a
new variant (Triton otherwise specialises ints on == 1 and % 16 == 0): warm-up before CUDA-graph
capture then covers every M. Checks that each listed name is a real argument."""
import os

import pytest

from tmoe.kernels import align, moe_gemm, quant, router

KERNELS = [moe_gemm._moe_gemm_kernel, align._align_single_kernel, align._align_count_kernel,
           align._align_scan_kernel, align._align_scatter_kernel, quant._per_token_group_quant_fp8_kernel,
           router._topk_route_kernel]


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.fn.__name__ if hasattr(k, "fn") else str(k))
def test_do_not_specialize_names_are_arguments(kernel):
    if os.environ.get("TRITON_INTERPRET") == "1":
        names, args = kernel.kwargs["do_not_specialize"], kernel.arg_names
    else:
        names, args = kernel.do_not_specialize, kernel.arg_names
    assert names and set(names) <= set(args), f"unknown names {set(names) - set(args)}"
