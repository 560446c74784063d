"""Every tmoe kernel compiles for Hopper (sm_90) with the installed Triton, without a GPU: the
interpreter runs the kernels' Python, this checks that the compiler accepts them (the TMA and
wgmma paths, and the programmatic-dependent-launch variants, included), so a Triton release that
rejects our code fails on CPU CI."""
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNELS = (
    "_align_count_kernel _align_scan_kernel _align_scatter_kernel _align_single_kernel _align_sort_kernel "
    "_batched_dispatch_kernel _lora_slots_kernel "
    "_moe_down_reduce_kernel _moe_fused_decode_kernel _moe_gemm_kernel _moe_grad_act_kernel _moe_grad_bias_kernel "
    "_moe_grad_input_kernel "
    "_grouped_gemm_kernel _moe_grad_weight_kernel _moe_grad_weight_tma_kernel _moe_partial_reduce_kernel _moe_reduce_kernel _per_token_group_quant_fp8_kernel "
    "_per_token_quant_fp8_kernel _sorted_rows_kernel _static_quant_fp8_kernel _topk_route_grad_kernel _topk_route_kernel _zero_kernel"
).split()

# launched with launch_pdl and compiled with gdc_wait / gdc_launch_dependents under override_pdl(True)
PDL_KERNELS = sorted(set(KERNELS) - {"_batched_dispatch_kernel", "_sorted_rows_kernel", "_topk_route_kernel", "_zero_kernel", "_moe_grad_act_kernel",
                                      "_moe_grad_bias_kernel", "_moe_grad_input_kernel", "_moe_grad_weight_kernel",
                                      "_moe_grad_weight_tma_kernel", "_topk_route_grad_kernel"})

# tmoe.testing.sm90: a stand-in CUDA driver reports an sm_90 device; launches only compile, nothing runs.
SCRIPT = textwrap.dedent("""
    import re

    import torch

    from tmoe.testing.sm90 import compile_only_sm90

    compiled = []
    lora_ptxs = set()  # the LoRA GEMMs': their epilogue's rank-deep MMA follows the trigger by design
    swapped = []  # (QUANT, ptx) of the swap_ab GEMMs

    cubins = {}  # the first cubin of each kernel
    lora_cubins = []  # (name:tile, cubin) of the LoRA GEMMs: the grouped core's, the input gradient's, serving's
    over = set()  # kernels whose shared memory exceeds Hopper's 227 KB per block (launch would fail)

    def record(name, kwargs, kernel):
        compiled.append((name, kernel.asm["ptx"], kernel.metadata.launch_pdl))
        if kwargs.get("LORA"):
            lora_ptxs.add(kernel.asm["ptx"])
        if kernel.metadata.shared > 232448:
            over.add(f"{name}:{kernel.metadata.shared}")
        cubins.setdefault(name, kernel.asm["cubin"])
        if kwargs.get("LORA") and (name in ("_grouped_gemm_kernel", "_moe_grad_input_kernel")
                                   or kwargs.get("LORA_ADAPTERS")):
            lora_cubins.append((f"{name}:{kwargs['BLOCK_M']}x{kwargs['BLOCK_N']}", kernel.asm["cubin"]))
        if kwargs.get("SWAP_AB"):
            swapped.append((kwargs["QUANT"], kernel.asm["ptx"]))

    compile_only_sm90(record)

    import tmoe
    from tmoe.testing.strategies import MoEShape, make_problem

    FP8 = torch.float8_e4m3fn
    p = make_problem(MoEShape(9, 4, 128, 256, 2), torch.bfloat16, "uniform", seed=0)
    fp8 = dict(quant_config=tmoe.FusedMoEQuantConfig(FP8, block_shape=(128, 128)),
               w1_scale=torch.ones(4, 2, 2), w2_scale=torch.ones(4, 2, 1))
    for route in ("sorted", "direct", "fused", "grouped"):  # grouped: persistent and TMA whatever the config
        for tma, persistent in ((False, False), (True, False), (True, True)):
            cfg = tmoe.GemmConfig(64, 128, 128, tma=tma, persistent=persistent)
            with tmoe.override_route(route), tmoe.override_config(tmoe.MoEConfig(cfg, cfg)):
                tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
                tmoe.fused_experts(p.x, p.w1.to(FP8), p.w2.to(FP8), p.topk_weights, p.topk_ids, **fp8)
    for scheme in ("int4", "mxfp4"):  # low-bit weights: int4 with zero points, mxfp4
        g = 32 if scheme == "mxfp4" else 128
        if scheme == "mxfp4":
            (q1, s1), (q2, s2), z1, z2 = tmoe.quantize_weight_mxfp4(p.w1), tmoe.quantize_weight_mxfp4(p.w2), None, None
        else:
            q1, s1, z1 = tmoe.quantize_weight_int4(p.w1, g, zero_point=True)
            q2, s2, z2 = tmoe.quantize_weight_int4(p.w2, g, zero_point=True)
        low_bit = dict(quant_config=tmoe.FusedMoEQuantConfig(weight_dtype=scheme, group_size=g), w1_scale=s1,
                       w2_scale=s2, w1_zp=z1, w2_zp=z2)
        for route in ("sorted", "direct", "fused"):
            with tmoe.override_route(route):
                tmoe.fused_experts(p.x, q1, q2, p.topk_weights, p.topk_ids, **low_bit)
        if scheme == "int4":  # a non-gated activation: w1 (E, N, K / 2), its zero points two rows per byte
            n1, t1, y1 = tmoe.quantize_weight_int4(p.w1[:, : p.w1.shape[1] // 2].contiguous(), g, zero_point=True)
            tmoe.fused_experts(p.x, n1, q2, p.topk_weights, p.topk_ids, activation="relu2_no_mul",
                               **{**low_bit, "w1_scale": t1, "w1_zp": y1})
        swap = tmoe.GemmConfig(16, 64, g, swap_ab=True)  # swap_ab: the weights as wgmma's LHS at block_m 16
        with tmoe.override_route("sorted"), tmoe.override_config(tmoe.MoEConfig(swap, swap)):
            tmoe.fused_experts(p.x, q1, q2, p.topk_weights, p.topk_ids, **low_bit)
    swap = tmoe.GemmConfig(16, 64, 128, swap_ab=True)
    with tmoe.override_route("sorted"), tmoe.override_config(tmoe.MoEConfig(swap, swap)):
        tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
        tmoe.fused_experts(p.x, p.w1.to(FP8), p.w2.to(FP8), p.topk_weights, p.topk_ids, **fp8)
    batched = tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(16, 4), tmoe.BatchedTritonExperts(16))
    batched(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
    wt1, wt2 = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (p.w1, p.w2))  # stored transposed: HALVES
    for route in ("sorted", "fused"):
        with tmoe.override_route(route):
            tmoe.fused_experts(p.x, wt1, wt2, p.topk_weights, p.topk_ids)
    # the backward kernels: the layer's (every operand by TMA; with biases, swigluoai interleaved: the
    # pointer path of moe_grad_act) and the router's
    train = [t.clone().requires_grad_() for t in (p.x, p.w1, p.w2, p.topk_weights)]
    tmoe.fused_experts(*train, p.topk_ids).sum().backward()  # the saved pre-activation (slot route's up GEMM)
    with tmoe.override_route("grouped"):  # the grouped core's up GEMM storing the pre-activation
        tmoe.fused_experts(*train, p.topk_ids).sum().backward()
    tmoe.fused_experts(*train, p.topk_ids, save_preactivation=False).sum().backward()  # recomputed
    odd = make_problem(MoEShape(9, 4, 64, 100, 2), torch.bfloat16, "uniform", seed=0)  # 200-byte rows: pointers
    tmoe.fused_experts(*(t.requires_grad_() for t in (odd.x, odd.w1, odd.w2, odd.topk_weights)),
                       odd.topk_ids).sum().backward()
    b1, b2 = torch.zeros(4, 256, requires_grad=True), torch.zeros(4, 256, requires_grad=True)
    tmoe.fused_experts(*train[:3], train[3], p.topk_ids, activation="swigluoai", gate_up_interleaved=True,
                       w1_bias=b1, w2_bias=b2).sum().backward()
    # frozen block-fp8 experts: the backward dequantizes w1/w2 in its kernels (bf16 x, the align
    # blocks of few experts, 128 rows, and of many, 64)
    tmoe.fused_experts(train[0], p.w1.to(FP8), p.w2.to(FP8), train[3], p.topk_ids, **fp8).sum().backward()
    many = make_problem(MoEShape(9, 32, 128, 256, 2), torch.bfloat16, "uniform", seed=0)
    tmoe.fused_experts(many.x.requires_grad_(), many.w1.to(FP8), many.w2.to(FP8), many.topk_weights.requires_grad_(),
                       many.topk_ids, quant_config=fp8["quant_config"], w1_scale=torch.ones(32, 2, 2),
                       w2_scale=torch.ones(32, 2, 1)).sum().backward()
    tmoe.fused_experts(many.x, many.w1.to(FP8), many.w2.to(FP8), many.topk_weights, many.topk_ids,  # interleaved rows
                       activation="swigluoai", gate_up_interleaved=True, quant_config=fp8["quant_config"],
                       w1_scale=torch.ones(32, 2, 2), w2_scale=torch.ones(32, 2, 1)).sum().backward()
    # LoRA adapters on frozen experts: the epilogue's rank-deep term (slot and sorted routes), the
    # factor rows of the backward and the input gradients' term (ranks 8 and 32)
    lora = dict(w1_lora_a=torch.randn(4, 8, 256), w1_lora_b=torch.randn(4, 256, 8), w2_lora_a=torch.randn(4, 32, 128),
                w2_lora_b=torch.randn(4, 256, 32))
    lora = {name: t.to(torch.bfloat16).requires_grad_() for name, t in lora.items()}
    for route in ("slots", "sorted", "grouped"):
        with tmoe.override_route(route):
            tmoe.fused_experts(train[0], p.w1, p.w2, p.topk_weights, p.topk_ids, lora_scale=2.0,
                               **lora).sum().backward()
    # QLoRA on frozen low-bit experts: g's and dX's GEMMs dequantize the codes in their K loops
    q1, s1, z1 = tmoe.quantize_weight_int4(p.w1.float(), 32)
    q2, s2, z2 = tmoe.quantize_weight_int4(p.w2.float(), 32)
    int4 = dict(quant_config=tmoe.FusedMoEQuantConfig(weight_dtype="int4", group_size=32), w1_scale=s1.bfloat16(),
                w2_scale=s2.bfloat16(), w1_zp=z1, w2_zp=z2)
    tmoe.fused_experts(train[0], q1, q2, p.topk_weights, p.topk_ids, **int4, **lora).sum().backward()
    (m1, e1), (m2, e2) = tmoe.quantize_weight_mxfp4(p.w1.float()), tmoe.quantize_weight_mxfp4(p.w2.float())
    mxfp4 = dict(quant_config=tmoe.FusedMoEQuantConfig(weight_dtype="mxfp4", group_size=32), w1_scale=e1, w2_scale=e2)
    tmoe.fused_experts(train[0], m1, m2, train[3], p.topk_ids, **mxfp4).sum().backward()
    # several adapters served at once (8 of rank 16, stacked; each token its own or none)
    stacked = dict(w1_lora_a=(8, 4, 16, 256), w1_lora_b=(8, 4, 256, 16), w2_lora_a=(8, 4, 16, 128),
                   w2_lora_b=(8, 4, 256, 16))
    stacked = {name: torch.randn(shape).to(torch.bfloat16) for name, shape in stacked.items()}
    for route in ("slots", "sorted"):
        with tmoe.override_route(route), torch.no_grad():
            tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids,
                               lora_ids=torch.randint(-1, 8, (9,), dtype=torch.int32), **stacked)
    tmoe.topk_route(torch.randn(9, 16, requires_grad=True), 2)[0].sum().backward()
    tmoe.per_token_quant_fp8(p.x)
    tmoe.static_quant_fp8(p.x, torch.ones(1))
    tmoe.topk_route(torch.randn(9, 16), 2, scoring="sigmoid", num_expert_group=4, topk_group=2,
                    e_score_correction_bias=torch.zeros(16))
    tmoe.moe_align_block_size(torch.randint(0, 8, (3000, 2), dtype=torch.int32), 16, 8)
    from tmoe.kernels import align
    sort_max, align.SORT_MAX_SLOTS = align.SORT_MAX_SLOTS, 4096  # the sorting align program at 2048 slots
    tmoe.moe_align_block_size(torch.randint(0, 128, (256, 8), dtype=torch.int32), 16, 128)
    align.SORT_MAX_SLOTS = sort_max
    from tmoe.testing.sm90 import sass
    print(re.search(r"REG:\\d+", sass(cubins["_moe_gemm_kernel"])).group(0))  # the disassembler runs
    print(" ".join(sorted({name for name, _, _ in compiled})))
    print(sum("cp.async.bulk.tensor" in ptx for _, ptx, _ in compiled), sum("wgmma" in ptx for _, ptx, _ in compiled))
    # swap_ab GEMMs: wgmma (M = block_n) and no mma.sync; low-bit ones take the weights from registers
    reg_a = r"wgmma\\.mma_async[^;]*\\},\\s*\\{"  # {acc}, {A registers}, B descriptor
    mma = lambda ptx: "mma.sync" if "mma.sync" in ptx or "wgmma" not in ptx else "regA" if re.search(reg_a, ptx) else "wgmma"
    print(" ".join(sorted({f"{q}:{mma(ptx)}" for q, ptx in swapped})))
    # the PTX unpacking of packed 4-bit codes (a GPU picks it from its device; forced here): one-group
    # K steps in bf16 and fp16, and steps over two groups (bf16 mxfp4, bf16/fp16 int4 with zero points:
    # scales multiplied, zero points subtracted in the PTX)
    from tmoe.kernels import gemm_args, operands
    from tmoe.runtime.state import clear_launch_caches
    gemm_args.asm_unpack = lambda scales, a, config, tile_n: (
        isinstance(scales, operands.WeightScales) and scales.weight_dtype != "int8" and a.dtype != torch.float32)
    clear_launch_caches()
    unpacked = []
    for scheme, dtype, groups in (("int4", torch.bfloat16, 1), ("int4", torch.float16, 1), ("mxfp4", torch.bfloat16, 1),
                                  ("mxfp4", torch.float16, 1), ("mxfp4", torch.bfloat16, 2), ("int4", torch.bfloat16, 2),
                                  ("int4", torch.float16, 2)):
        g = 32 if scheme == "mxfp4" else 128
        w1, w2 = p.w1.to(dtype), p.w2.to(dtype)
        if scheme == "mxfp4":
            (q1, s1), (q2, s2), z1, z2 = tmoe.quantize_weight_mxfp4(w1), tmoe.quantize_weight_mxfp4(w2), None, None
        else:
            q1, s1, z1 = tmoe.quantize_weight_int4(w1, g, zero_point=True)
            q2, s2, z2 = tmoe.quantize_weight_int4(w2, g, zero_point=True)
        low_bit = dict(quant_config=tmoe.FusedMoEQuantConfig(weight_dtype=scheme, group_size=g), w1_scale=s1,
                       w2_scale=s2, w1_zp=z1, w2_zp=z2)
        tiles = tmoe.GemmConfig(16, 64, g * groups)
        compiled.clear()
        for route in ("sorted", "fused"):
            with tmoe.override_route(route), tmoe.override_config(tmoe.MoEConfig(tiles, tiles)):
                tmoe.fused_experts(p.x.to(dtype), q1, q2, p.topk_weights, p.topk_ids, **low_bit)
        gemms = [ptx for name, ptx, _ in compiled if name in ("_moe_gemm_kernel", "_moe_fused_decode_kernel")]
        mul, sub = ("mul.rn.bf16x2", "sub.rn.bf16x2") if dtype == torch.bfloat16 else ("mul.rn.f16x2", "sub.rn.f16x2")
        scaled = scheme == "mxfp4" or groups > 1  # int4 over several groups: minus zero points, times scales
        ok = len(gemms) == 3 and all("prmt.b32" in ptx and "lop3.b32" in ptx and (not scaled or mul in ptx)
                                     and (scheme == "mxfp4" or groups == 1 or sub in ptx) for ptx in gemms)
        unpacked.append(f"{scheme}-{str(dtype)[6:]}-{groups}:{'ok' if ok else 'missing'}")
    print(" ".join(unpacked))
    # the PDL variants of the decode-path kernels (programmatic dependent launch)
    compiled.clear()
    persistent = tmoe.GemmConfig(64, 128, 128, tma=True, persistent=True)
    with tmoe.override_pdl(True):
        for route in ("sorted", "direct", "fused", "grouped"):
            with tmoe.override_route(route):
                tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
                tmoe.fused_experts(p.x, p.w1.to(FP8), p.w2.to(FP8), p.topk_weights, p.topk_ids, **fp8)
        with tmoe.override_route("sorted"), tmoe.override_config(tmoe.MoEConfig(persistent, persistent)):
            tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
        batched(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
        with torch.no_grad():  # several adapters: the slot adapters' kernel
            tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids,
                               lora_ids=torch.randint(-1, 8, (9,), dtype=torch.int32), **stacked)
        tmoe.per_token_quant_fp8(p.x)
        tmoe.static_quant_fp8(p.x, torch.ones(1))
        tmoe.moe_align_block_size(torch.randint(0, 8, (3000, 2), dtype=torch.int32), 16, 8)
        sort_max, align.SORT_MAX_SLOTS = align.SORT_MAX_SLOTS, 4096
        tmoe.moe_align_block_size(torch.randint(0, 128, (256, 8), dtype=torch.int32), 16, 128)
        align.SORT_MAX_SLOTS = sort_max
    pdl = [(name, "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx, launch_pdl)
           for name, ptx, launch_pdl in compiled]
    print(" ".join(sorted({name for name, waits, launch_pdl in pdl if waits and launch_pdl})))
    print(" ".join(sorted({name for name, waits, launch_pdl in pdl if waits != launch_pdl})) or "-")

    MMA = "mma.sync|wgmma.mma_async"
    MEMORY = r"ld\\.global|st\\.global|cp\\.async|red\\.global|atom\\.global"

    def first(ptx, pattern):
        return min((m.start() for m in re.finditer(pattern, ptx)), default=len(ptx))

    def late(ptx):  # the trigger after the wait and after the last MMA (the K loop; a LoRA epilogue's follow it)
        trigger = first(ptx, "griddepcontrol.launch_dependents")
        mma = [] if ptx in lora_ptxs else [m.start() for m in re.finditer(MMA, ptx)]
        return first(ptx, "griddepcontrol.wait") < trigger < len(ptx) and all(i < trigger for i in mma)

    print(" ".join(sorted({name for name, ptx, launch_pdl in compiled if launch_pdl and not late(ptx)})) or "-")
    # the wait before the first global memory access (load, store, async copy)
    print(" ".join(sorted({name for name, ptx, launch_pdl in compiled
                           if launch_pdl and first(ptx, MEMORY) < first(ptx, "griddepcontrol.wait")})) or "-")
    print(" ".join(sorted(over)) or "-")
    # the LoRA term accumulates onto the tile: at most a few spilled registers at 128 x 256 tiles (Triton
    # 3.6: 0-8 bytes of stack, 3.9: up to 80; a separate [BM, BN] product spilled 592-672)
    stack = lambda cubin: re.search(r"STACK:(\\d+)", sass(cubin)).group(1)
    stacks = {name + ":" + stack(cubin) for name, cubin in lora_cubins}
    print(" ".join(sorted(stacks)))
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the other tests compile the kernels for real")
def test_every_kernel_compiles_for_sm90(tmp_path):
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    regs, names, counts, swap, unpacked, pdl_names, mismatched, not_late, not_first, over, lora_stacks = \
        proc.stdout.strip().splitlines()[-11:]
    assert int(regs.removeprefix("REG:")) > 0, f"tmoe.testing.sm90.sass: {regs}"
    assert names.split() == sorted(KERNELS)
    tma_loads, wgmma = map(int, counts.split())
    assert tma_loads > 0 and wgmma > 0, "the TMA and wgmma paths must be compiled too"
    assert swap.split() == ["block:wgmma", "int4:regA", "mxfp4:regA", "none:wgmma"], \
        f"swap_ab GEMMs must use wgmma only, low-bit weights from registers: {swap}"
    assert all(u.endswith(":ok") for u in unpacked.split()) and len(unpacked.split()) == 7, \
        f"the 4-bit GEMMs (the aligned path's two and the fused decode kernel) must compile the PTX unpacking (prmt, lop3; mxfp4 and multi-group int4 their 16x2 " \
        f"multiply, int4 its subtract): {unpacked}"
    assert pdl_names.split() == sorted(PDL_KERNELS), "with override_pdl(True) these launch with PDL and wait"
    assert mismatched == "-", f"launched with PDL but no griddepcontrol (or the reverse): {mismatched}"
    assert not_late == "-", f"these trigger their dependents before their wait or inside the K loop: {not_late}"
    assert not_first == "-", f"these touch global memory before their wait: {not_first}"
    assert over == "-", f"these need more shared memory than an sm_90 block has (227 KB): {over}"
    assert lora_stacks and all(int(s.rsplit(":", 1)[1]) <= 128 for s in lora_stacks.split()), \
        f"the LoRA GEMMs spill registers (name:tile:stack bytes; a separate product spilled 592-672): {lora_stacks}"
