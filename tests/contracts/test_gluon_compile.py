"""Every variant of the warp-specialized Gluon engine compiles for Hopper (sm_90) with the installed
Triton, without a GPU (Gluon kernels do not run under the interpreter; ``tmoe.testing.sm90`` stands
in an sm_90 driver and only compiles): the dense matmul's tile configs and the grouped GEMMs (up with
every activation and the router weight on either GEMM in bf16, fp16 and block_m 64 with silu; down;
fp8 with per-token and per-channel scales; biases and the saved pre-activation) and the input
gradient's GEMM (per slot with the router gradient, and in aligned order), each
with a warp-specialized producer (``ttg.warp_specialize``), wgmma and TMA in its code, within
Hopper's 227 KB of shared memory and without spilling registers to local memory."""
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMEM_LIMIT = 232448  # bytes of shared memory an sm_90 block may opt into

SCRIPT = textwrap.dedent("""
    import re

    import torch

    from tmoe.testing.sm90 import compile_only_sm90, sass

    rows = []

    def record(name, kwargs, kernel):
        spills = re.findall(r"LOCAL:(\\d+)", sass(kernel.asm["cubin"]))
        ttgir = kernel.asm["ttgir"]
        ok = all(s in ttgir for s in ("warp_specialize", "warp_group_dot", "async_tma_copy_global_to_local"))
        rows.append(f"{name} {kernel.metadata.shared} {max(map(int, spills or ['0']))} {int(ok)}")

    compile_only_sm90(record)

    from tmoe.kernels.activation import ACTIVATIONS, Activation
    from tmoe.kernels.gemm_config import GemmConfig
    from tmoe.kernels.gluon_grouped import invoke_gluon_grouped_gemm
    from tmoe.kernels.gluon_matmul import gluon_dense_matmul
    from tmoe.kernels.operands import Routing

    a, b = torch.empty(512, 1024, dtype=torch.bfloat16), torch.empty(768, 1024, dtype=torch.bfloat16)
    for cfg in (GemmConfig(128, 256, 64, num_warps=8, num_stages=3), GemmConfig(128, 128, 64, num_warps=4, num_stages=4),
                GemmConfig(128, 128, 64, num_warps=8, num_stages=4)):
        gluon_dense_matmul(a, b, cfg, 132)
    e, n, k, slots = 4, 256, 512, 600
    # every activation and router-weight placement in bf16 at block_m 128; fp16 and block_m 64 with silu
    for dtype, bm, names in ((torch.bfloat16, 128, ACTIVATIONS), (torch.float16, 128, ("silu", )),
                             (torch.bfloat16, 64, ("silu", ))):
        em = 1024
        routing = Routing(torch.zeros(em, dtype=torch.int32), torch.zeros(em // bm, dtype=torch.int32),
                          torch.zeros(1, dtype=torch.int32), slots, 2)
        x, inter = torch.empty(em, k, dtype=dtype), torch.empty(em, n, dtype=dtype)
        w1, w2 = torch.empty(e, 2 * n, k, dtype=dtype), torch.empty(e, k, n, dtype=dtype)
        up, down = GemmConfig(bm, 128, 64, num_warps=8), GemmConfig(bm, 256, 64, num_warps=8)
        for name in names:
            act = Activation(name)
            w = w1 if act.mul else w1[:, :n].contiguous()
            for weights in (None, torch.empty(slots)):
                invoke_gluon_grouped_gemm(x, w, inter, up, routing, 132, gated=True, activation=act,
                                          topk_weights=weights)
        for weights in (None, torch.empty(slots)):
            invoke_gluon_grouped_gemm(inter, w2, torch.empty(slots, k, dtype=dtype), down, routing, 132,
                                      gated=False, topk_weights=weights)
    # fp8 operands with per-token and per-channel scales; biases and the saved pre-activation
    from tmoe.kernels.operands import Scales
    fp8, routing = torch.float8_e4m3fn, Routing(torch.zeros(1024, dtype=torch.int32), torch.zeros(8, dtype=torch.int32),
                                                torch.zeros(1, dtype=torch.int32), slots, 2)
    for dtype, bk in ((fp8, 128), (torch.bfloat16, 64)):
        s1 = Scales(torch.empty(1024, 1), torch.empty(e, 2 * n, 1)) if dtype == fp8 else None
        s2 = Scales(torch.empty(1024, 1), torch.empty(e, k, 1)) if dtype == fp8 else None
        invoke_gluon_grouped_gemm(torch.empty(1024, k, dtype=dtype), torch.empty(e, 2 * n, k, dtype=dtype),
                                  torch.empty(1024, n, dtype=torch.bfloat16), GemmConfig(128, 128, bk, num_warps=8),
                                  routing, 132, gated=True, scales=s1, bias=torch.empty(e, 2 * n, dtype=torch.bfloat16),
                                  pre_out=torch.empty(slots, 2 * n, dtype=torch.bfloat16))
        invoke_gluon_grouped_gemm(torch.empty(1024, n, dtype=dtype), torch.empty(e, k, n, dtype=dtype),
                                  torch.empty(slots, k, dtype=torch.bfloat16), GemmConfig(128, 256, bk, num_warps=8),
                                  routing, 132, gated=False, scales=s2, bias=torch.empty(e, k, dtype=torch.bfloat16))
    # the input gradient's GEMM: per slot with the router weights' gradient, and in aligned order
    from tmoe.kernels.gluon_grad_input import invoke_gluon_grad_input
    d, w = torch.empty(1024, 2 * n, dtype=torch.bfloat16), torch.empty(e, 2 * n, k, dtype=torch.bfloat16)
    ids, blocks = torch.zeros(1024, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    padded, cfg = torch.zeros(1, dtype=torch.int32), GemmConfig(128, 256, 64, num_warps=8)
    invoke_gluon_grad_input(d, w, torch.empty(slots, k, dtype=torch.bfloat16), ids, blocks, padded, slots, 128, cfg,
                            132, torch.empty(1024, 9), torch.empty(slots))
    invoke_gluon_grad_input(d, w, torch.empty(1024, k, dtype=torch.bfloat16), ids, blocks, padded, slots, 128, cfg, 132)
    print("\\n".join(rows))
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU tests/kernels/test_gluon_engine.py runs the engine")
def test_gluon_engine_compiles_for_sm90(tmp_path):
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line.split() for line in proc.stdout.strip().splitlines()]
    names = {r[0] for r in rows}
    assert names == {"_gluon_dense_kernel", "_gluon_grouped_kernel", "_gluon_grad_input_kernel"}, names
    assert len(rows) == 3 + (2 * 7 + 2) + 2 * (2 + 2) + 4 + 2, f"every variant compiled: {len(rows)} compiles"
    for name, shared, spilled, ok in rows:
        assert int(shared) <= SMEM_LIMIT, f"{name} needs {shared} bytes of shared memory (sm_90: {SMEM_LIMIT})"
        assert int(spilled) == 0, f"{name} spills {spilled} bytes of registers to local memory"
        assert ok == "1", f"{name}: no warp-specialized producer, wgmma or TMA load in its TTGIR"
