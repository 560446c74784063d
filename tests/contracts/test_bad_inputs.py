"""The bad-input table (docs/bad_inputs.md), one test per row: each input gets a clear error
naming the argument before any launch, or its documented result. Rows that once corrupted
memory run in a subprocess, so a crash fails the test instead of the run."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from unittest import mock

import pytest
import torch

import tmoe
from tmoe.reference import moe_reference
from tmoe.runtime import interpreter
from tmoe.testing import assert_close
from tmoe.testing.strategies import MoEShape, make_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, N, K, M, TOPK = 4, 64, 64, 5, 2


def _p(**kw):
    return make_problem(MoEShape(M, E, N, K, TOPK), torch.float32, "uniform", seed=5, device=DEVICE)


def _fe(**overrides) -> Callable[[], object]:
    """A fused_experts call on a fresh small problem with some arguments replaced."""
    def call():
        p = _p()
        args = dict(hidden_states=p.x, w1=p.w1, w2=p.w2, topk_weights=p.topk_weights, topk_ids=p.topk_ids)
        kwargs = {k: (v(p) if callable(v) else v) for k, v in overrides.items()}
        args.update({k: kwargs.pop(k) for k in list(kwargs) if k in args})
        return tmoe.fused_experts(**args, **kwargs)
    return call


def _fp8_problem(block_shape=(32, 32), n=N, k=K):
    p = make_problem(MoEShape(M, E, n, k, TOPK), torch.float32, "uniform", seed=6, device=DEVICE)
    w1q, s1 = tmoe.quantize_weight_per_block_fp8(p.w1, block_shape)
    w2q, s2 = tmoe.quantize_weight_per_block_fp8(p.w2, block_shape)
    return p, w1q, s1, w2q, s2


def _fp8_block_mismatch():
    p, w1q, s1, w2q, s2 = _fp8_problem((32, 32), n=48)
    qc = tmoe.FusedMoEQuantConfig(torch.float8_e4m3fn, block_shape=(32, 32))
    return tmoe.fused_experts(p.x, w1q, w2q, p.topk_weights, p.topk_ids, quant_config=qc, w1_scale=s1, w2_scale=s2)


def _fp8_no_scale():
    p, w1q, s1, w2q, s2 = _fp8_problem()
    qc = tmoe.FusedMoEQuantConfig(torch.float8_e4m3fn, block_shape=(32, 32))
    return tmoe.fused_experts(p.x, w1q, w2q, p.topk_weights, p.topk_ids, quant_config=qc, w2_scale=s2)


def _fp8_weights_no_config():
    p, w1q, s1, w2q, s2 = _fp8_problem()
    return tmoe.fused_experts(p.x, w1q, w2q, p.topk_weights, p.topk_ids, w1_scale=s1, w2_scale=s2)


def _low_bit(weight_dtype: str, **overrides) -> Callable[[], object]:
    """fused_experts on a small problem quantized to ``weight_dtype`` (int4/int8 with zero points,
    group 32), some arguments replaced: a value, or a function of the problem and the arguments."""
    def call():
        p = _p()
        if weight_dtype == "mxfp4":
            (q1, s1), (q2, s2) = tmoe.quantize_weight_mxfp4(p.w1), tmoe.quantize_weight_mxfp4(p.w2)
            z1 = z2 = None
        else:
            quantize = tmoe.quantize_weight_int4 if weight_dtype == "int4" else tmoe.quantize_weight_int8
            (q1, s1, z1), (q2, s2, z2) = quantize(p.w1, 32), quantize(p.w2, 32)
        args = dict(hidden_states=p.x, w1=q1, w2=q2, topk_weights=p.topk_weights, topk_ids=p.topk_ids,
                    w1_scale=s1, w2_scale=s2, w1_zp=z1, w2_zp=z2,
                    quant_config=tmoe.FusedMoEQuantConfig(weight_dtype=weight_dtype, group_size=32))
        args.update({k: (v(p, args) if callable(v) else v) for k, v in overrides.items()})
        return tmoe.fused_experts(**args)
    return call


def _static_scale(value: float, name: str):
    def call():
        p = _p()
        w1q, s1 = tmoe.quantize_weight_per_tensor_fp8(p.w1)
        w2q, s2 = tmoe.quantize_weight_per_tensor_fp8(p.w2)
        qc = tmoe.FusedMoEQuantConfig(torch.float8_e4m3fn)
        scale = torch.tensor([value], device="cpu")
        good = torch.tensor([0.05], device="cpu")
        kw = {"a1_scale": good, "a2_scale": good, name: scale}
        return tmoe.fused_experts(p.x.cpu(), w1q.cpu(), w2q.cpu(), p.topk_weights.cpu(), p.topk_ids.cpu(),
                                  quant_config=qc, w1_scale=s1.cpu(), w2_scale=s2.cpu(), **kw)
    return call


def _inplace(make_x):
    def call():
        p = _p()
        return tmoe.fused_experts(make_x(p), p.w1, p.w2, p.topk_weights, p.topk_ids, inplace=True)
    return call


def _grad_through(kernel: tmoe.FusedMoEModularKernel):
    """A call that needs gradients through ``kernel`` (refused before any launch when it has no backward)."""
    def call():
        p = _p()
        return kernel(p.x.clone().requires_grad_(True), p.w1, p.w2, p.topk_weights, p.topk_ids)
    return call


def _grad_through_fp8():
    p = _p()
    w1q, s1 = tmoe.quantize_weight_per_channel_fp8(p.w1)
    w2q, s2 = tmoe.quantize_weight_per_channel_fp8(p.w2)
    qc = tmoe.FusedMoEQuantConfig(torch.float8_e4m3fn, per_act_token_quant=True, per_out_ch_quant=True)
    return tmoe.fused_experts(p.x, w1q.requires_grad_(), w2q, p.topk_weights, p.topk_ids, quant_config=qc,
                              w1_scale=s1, w2_scale=s2)


def _grad_through_int4_recomputed():
    p = _p()
    (q1, s1, _), (q2, s2, _) = (tmoe.quantize_weight_int4(w, 32) for w in (p.w1, p.w2))
    qc = tmoe.FusedMoEQuantConfig(weight_dtype="int4", group_size=32)
    return tmoe.fused_experts(p.x.clone().requires_grad_(), q1, q2, p.topk_weights, p.topk_ids, quant_config=qc,
                              w1_scale=s1, w2_scale=s2, save_preactivation=False)


def _router_logits_mismatch():
    layer = tmoe.FusedMoE(4, K, N, 2, router=False, dtype=torch.float32, device=DEVICE)
    return layer(torch.randn(3, K, device=DEVICE), router_logits=torch.randn(3, 5, device=DEVICE))


def _stage_block_m_mismatch():
    p = _p()
    align = torch.ops.tmoe.moe_align_block_size(p.topk_ids, 16, E)
    return torch.ops.tmoe.moe_gemm_up(p.x, p.w1, *align, TOPK, 32)


def _stage_low_bit(**overrides) -> Callable[[], object]:
    """moe_gemm_up on int4 codes with zero points (group 32), some keyword arguments replaced: a value,
    or a function of the problem and the arguments."""
    def call():
        p = _p()
        q1, s1, z1 = tmoe.quantize_weight_int4(p.w1, 32)
        args = dict(x=p.x, w1=q1, w_scale=s1, w_zp=z1, weight_dtype="int4", group_size=32)
        args.update({k: (v(p, args) if callable(v) else v) for k, v in overrides.items()})
        align = torch.ops.tmoe.moe_align_block_size(p.topk_ids, 16, E)
        return torch.ops.tmoe.moe_gemm_up(args.pop("x"), args.pop("w1"), *align, TOPK, 16, **args)
    return call


def _modular(pf, experts, chunk_size=None):
    return lambda: tmoe.FusedMoEModularKernel(pf(), experts(), chunk_size=chunk_size)


def _subprocess(code: str) -> Callable[[], None]:
    """Run ``code`` in a fresh interpreter; re-raise its last exception line as ValueError, so a
    crash (signal, heap corruption) fails the row instead of the test run."""
    def call():
        run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                             timeout=300)
        if run.returncode < 0 or run.returncode > 1:
            raise AssertionError(f"subprocess crashed (rc {run.returncode}): {run.stderr[-2000:]}")
        if run.returncode == 1:
            raise ValueError(run.stderr.strip().splitlines()[-1])
    return call


_BATCHED_WRONG_EXPERTS = """
    import torch, tmoe
    from tmoe.testing.strategies import MoEShape, make_problem
    p = make_problem(MoEShape(5, 4, 64, 64, 2), torch.float32, "uniform", seed=5)
    kernel = tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(6, 2), tmoe.BatchedTritonExperts(6))
    kernel(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
"""


@dataclass(frozen=True)
class Row:
    id: str
    call: Callable[[], object]
    error: type[BaseException]
    match: str  # regex the message must contain (it names the argument)


def _cpu_tensors_off_interpreter():
    """CPU tensors where the kernels run on a GPU (the interpreter off): a model left on the CPU of a
    GPU machine. Raised before any launch (Triton's own error names no argument)."""
    p = make_problem(MoEShape(M, E, N, K, TOPK), torch.float32, "uniform", seed=3, device="cpu")
    with mock.patch.object(interpreter, "INTERPRETED", False), mock.patch.object(torch.cuda, "is_available",
                                                                                  return_value=True):
        tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)


ROWS = [
    Row("hidden_states-int", _fe(hidden_states=lambda p: p.x.int()), TypeError, "hidden_states"),
    Row("hidden_states-1d", _fe(hidden_states=lambda p: p.x[0]), ValueError, "hidden_states"),
    Row("w1-dtype", _fe(w1=lambda p: p.w1.double()), TypeError, "w1 has dtype"),
    Row("w1-odd-rows", _fe(w1=lambda p: p.w1[:, :-1]), ValueError, "w1 must be"),
    Row("w1-wrong-k", _fe(w1=lambda p: p.w1[:, :, :-1]), ValueError, r"w1 must be \(E, 2N, K=64\)"),
    Row("w2-wrong-shape", _fe(w2=lambda p: p.w2[:, :-1]), ValueError, r"w2 must have shape \(4, 64, 64\)"),
    Row("w2-meta", _fe(w2=lambda p: p.w2.to("meta")), ValueError, "w2 must be on"),
    Row("topk_ids-meta", _fe(topk_ids=lambda p: p.topk_ids.to("meta")), ValueError, "topk_ids must be on"),
    Row("expert_map-meta", _fe(global_num_experts=4, expert_map=torch.arange(4, dtype=torch.int32, device="meta")),
        ValueError, "expert_map must be on"),
    Row("topk_ids-float", _fe(topk_ids=lambda p: p.topk_ids.float()), TypeError, "topk_ids"),
    Row("topk_ids-int16", _fe(topk_ids=lambda p: p.topk_ids.short()), TypeError, "topk_ids"),
    Row("topk_ids-rows", _fe(topk_ids=lambda p: p.topk_ids[:-1]), ValueError, "topk_ids must be"),
    Row("topk_ids-noncontiguous", _fe(topk_ids=lambda p: p.topk_ids.t().contiguous().t()), ValueError,
        "topk_ids must be contiguous"),
    Row("topk_weights-shape", _fe(topk_weights=lambda p: p.topk_weights[:, :1].contiguous()), ValueError,
        "topk_weights must have shape"),
    Row("activation-unknown", _fe(activation="relu"), ValueError, "activation must be one of"),
    Row("no_mul-w1-gated-shape", _fe(activation="silu_no_mul"), ValueError,
        r"w1 must be \(E, N, K\) for activation 'silu_no_mul': w2 \(E, K, N=64\) needs 64 rows of w1, got 128"),
    Row("swiglu_limit-zero", _fe(activation="swigluoai", swiglu_limit=0.0), ValueError, "swiglu_limit must be > 0"),
    Row("swiglu_limit-nan", _fe(activation="silu", swiglu_limit=float("nan")), ValueError, "swiglu_limit must be > 0"),
    Row("swiglu_limit-gelu", _fe(activation="gelu", swiglu_limit=5.0), ValueError,
        "swiglu_limit applies to activation silu or swigluoai"),
    Row("swiglu_alpha-silu", _fe(swiglu_alpha=1.5), ValueError, "swiglu_alpha applies to activation swigluoai"),
    Row("swiglu_alpha-inf", _fe(activation="swigluoai", swiglu_alpha=float("inf")), ValueError,
        "swiglu_alpha must be finite"),
    Row("swiglu_alpha-str", _fe(activation="swigluoai", swiglu_alpha="1.7"), TypeError, "swiglu_alpha must be a float"),
    Row("interleaved-no_mul", _fe(activation="relu2_no_mul", gate_up_interleaved=True,
                                  w1=lambda p: p.w1[:, :N].contiguous()), ValueError,
        "gate_up_interleaved needs a gated activation"),
    Row("fusedmoe-swiglu_limit-zero", lambda: tmoe.FusedMoE(4, K, N, 2, swiglu_limit=0.0), ValueError,
        "swiglu_limit must be > 0"),
    Row("router-weight-on-input-topk2", _fe(apply_router_weight_on_input=True), ValueError,
        "apply_router_weight_on_input needs topk == 1"),
    Row("w1_bias-shape", _fe(w1_bias=lambda p: torch.zeros(E, N, device=DEVICE)), ValueError, "w1_bias must have shape"),
    Row("expert_map-length", _fe(global_num_experts=8, expert_map=lambda p: torch.zeros(4, dtype=torch.int32,
                                                                                        device=DEVICE)),
        ValueError, r"expert_map must have shape \(8,\)"),
    Row("expert_map-int64", _fe(global_num_experts=4, expert_map=lambda p: torch.arange(4, device=DEVICE)),
        TypeError, "expert_map"),
    Row("global_num_experts-no-map", _fe(global_num_experts=8), ValueError, "no expert_map"),
    Row("unknown-option", _fe(actvation="silu"), TypeError, "actvation"),
    Row("fp8-weights-no-quant-config", _fp8_weights_no_config, TypeError, "pass a quant_config"),
    Row("fp8-missing-w1_scale", _fp8_no_scale, ValueError, "w1_scale"),
    Row("fp8-block-not-dividing-n", _fp8_block_mismatch, ValueError, r"block_shape\[1\]=32 .* N=48"),
    Row("int4-w1-unpacked", _low_bit("int4", w1=lambda p, a: a["w1"].repeat(1, 1, 2)), ValueError,
        r"w1 must be int4 codes of shape \(4, 128, 32\)"),
    Row("int4-w2-unpacked", _low_bit("int4", w2=lambda p, a: a["w2"].repeat(1, 1, 2)), ValueError,
        r"w2 must be int4 codes of shape \(4, 64, 32\)"),
    Row("int4-odd-n", _low_bit("int4", w1=lambda p, a: a["w1"][:, :126], w1_scale=lambda p, a: a["w1_scale"][:, :126],
                               w1_zp=lambda p, a: a["w1_zp"][:, :63]), ValueError,
        r"int4 packs 2 values per byte along w2's last dimension for the intermediate size N=63 \(w1's 126 rows\): "
        r"K_in=63 must be a multiple of 2"),
    Row("int4-no_mul-w1-gated-shape", _low_bit("int4", activation="relu2_no_mul"), ValueError,
        r"w1 must be \(E, N, K / 2\) for activation 'relu2_no_mul': w2 \(E, K, N / 2=32\) needs 64 rows of w1, got 128"),
    Row("int4-float-weights", _low_bit("int4", w1=lambda p, a: p.w1), TypeError, "w1 must have dtype in .*uint8"),
    Row("int4-missing-w2_scale", _low_bit("int4", w2_scale=None), ValueError, "int4 experts need w2_scale"),
    Row("int4-scale-shape", _low_bit("int4", w1_scale=lambda p, a: a["w1_scale"][..., :1]), ValueError,
        r"w1_scale must have shape \(4, 128, 2\)"),
    Row("int8-scale-int", _low_bit("int8", w2_scale=lambda p, a: a["w2_scale"].int()), TypeError,
        "w2_scale must have dtype"),
    Row("int4-zp-unpacked", _low_bit("int4", w1_zp=lambda p, a: a["w1_zp"].repeat(1, 2, 1)), ValueError,
        r"w1_zp must have shape \(4, 64, 2\)"),
    Row("int4-static-activation-scale", _low_bit("int4", a1_scale=lambda p, a: torch.ones(1, device=DEVICE)),
        ValueError, "a1_scale/a2_scale are fp8 activation scales"),
    Row("zp-without-scheme", _fe(w1_zp=lambda p: torch.zeros(E, N, 2, dtype=torch.uint8, device=DEVICE)),
        ValueError, "w1_zp/w2_zp are zero points of int4/int8 weights"),
    Row("mxfp4-zp", _low_bit("mxfp4", w2_zp=lambda p, a: torch.zeros(E, K // 2, 2, dtype=torch.uint8, device=DEVICE)),
        ValueError, "mxfp4 weights have no zero points"),
    Row("mxfp4-float-scale", _low_bit("mxfp4", w1_scale=lambda p, a: a["w1_scale"].float()), TypeError,
        "w1_scale must have dtype in .*uint8"),
    Row("a1_scale-zero", _static_scale(0.0, "a1_scale"), ValueError, "a1_scale must be a positive finite scale"),
    Row("a2_scale-negative", _static_scale(-1.0, "a2_scale"), ValueError, "a2_scale must be a positive"),
    Row("inplace-leaf-requires-grad", _inplace(lambda p: p.x.clone().requires_grad_(True)), RuntimeError,
        "requires grad"),
    Row("inplace-nonleaf-requires-grad", _inplace(lambda p: p.x.clone().requires_grad_(True) * 1.0), RuntimeError,
        "requires grad"),
    Row("inplace-expanded", _inplace(lambda p: p.x[:1].clone().expand(M, K)), RuntimeError, "overlap"),
    Row("backward-batched", _grad_through(tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(M * TOPK, E),
                                                                     tmoe.BatchedTritonExperts(M * TOPK))),
        NotImplementedError, "'batched' PrepareAndFinalize with 'batched_triton' experts has no backward"),
    Row("backward-fp8", _grad_through_fp8, NotImplementedError,
        r"quantized expert weights \(float8_e4m3fn\) cannot be trained"),
    Row("backward-low-bit-recomputed", _grad_through_int4_recomputed, NotImplementedError,
        r"frozen int4 experts read the forward's saved pre-activation: keep save_preactivation=True"),
    Row("router_logits-experts", _router_logits_mismatch, ValueError, r"router_logits must be \(tokens=3, num_experts=4\)"),
    Row("fusedmoe-topk", lambda: tmoe.FusedMoE(4, K, N, 5), ValueError, "topk must be in"),
    Row("chunk_size-zero", _modular(tmoe.NoEPPrepareAndFinalize, tmoe.TritonExperts, 0), ValueError, "chunk_size"),
    Row("chunk_size-env", lambda: _subprocess(
        "import os; os.environ['TMOE_CHUNK_SIZE'] = 'abc'\nimport tmoe\n"
        "tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts())")(),
        ValueError, "TMOE_CHUNK_SIZE must be a positive integer"),
    Row("experts-quant-config-str", lambda: tmoe.TritonExperts("fp8"), TypeError, "quant_config"),
    Row("block_shape-zero", lambda: tmoe.FusedMoEQuantConfig(torch.float8_e4m3fn, block_shape=(0, 0)), ValueError,
        "block_shape"),
    Row("block_shape-k-not-pow2", lambda: tmoe.FusedMoEQuantConfig(torch.float8_e4m3fn, block_shape=(128, 96)),
        ValueError, r"block_shape\[1\]"),
    Row("weight_dtype-unknown", lambda: tmoe.FusedMoEQuantConfig(weight_dtype="int3", group_size=32), ValueError,
        "weight_dtype must be"),
    Row("weight_dtype-no-group_size", lambda: tmoe.FusedMoEQuantConfig(weight_dtype="int4"), ValueError,
        "group_size"),
    Row("group_size-not-pow2", lambda: tmoe.FusedMoEQuantConfig(weight_dtype="int8", group_size=48), ValueError,
        "group_size"),
    Row("mxfp4-group_size", lambda: tmoe.FusedMoEQuantConfig(weight_dtype="mxfp4", group_size=64), ValueError,
        "group_size must be 32"),
    Row("weight_dtype-with-fp8", lambda: tmoe.FusedMoEQuantConfig(torch.float8_e4m3fn, weight_dtype="int4",
                                                                  group_size=32), ValueError, "weight-only"),
    Row("group_size-alone", lambda: tmoe.FusedMoEQuantConfig(group_size=32), ValueError, "needs a weight_dtype"),
    Row("quantize-int4-odd-k", lambda: tmoe.quantize_weight_int4(torch.randn(2, 4, 33), 32), ValueError, "even"),
    Row("mxfp4-blocks-shape", lambda: tmoe.mxfp4_from_blocks(torch.zeros(2, 4, 3, 16, dtype=torch.uint8),
                                                             torch.zeros(2, 4, 2, dtype=torch.uint8)), ValueError,
        "blocks"),
    Row("topk_ids-list", _fe(topk_ids=lambda p: p.topk_ids.tolist()), TypeError, "topk_ids must be a torch.Tensor"),
    Row("quant_config-str", _fe(quant_config="fp8"), TypeError, "quant_config must be a tmoe.FusedMoEQuantConfig"),
    Row("fusedmoe-input-dtype", lambda: tmoe.FusedMoE(4, K, N, 2, device=DEVICE)(torch.randn(3, K, device=DEVICE)),
        TypeError, r"hidden_states has dtype torch.float32 but this FusedMoE's weights are torch.bfloat16"),
    Row("fusedmoe-dtype-float64", lambda: tmoe.FusedMoE(4, K, N, 2, dtype=torch.float64), TypeError,
        "dtype must be one of"),
    Row("fusedmoe-router_logits-tokens", lambda: tmoe.FusedMoE(4, K, N, 2, router=False, dtype=torch.float32)(
        torch.randn(3, K), router_logits=torch.randn(5, 4)), ValueError, r"router_logits must be \(tokens=3"),
    Row("fusedmoe-scoring", lambda: tmoe.FusedMoE(4, K, N, 2, scoring="softmaxx"), ValueError,
        "scoring must be one of"),
    Row("fusedmoe-expert-groups", lambda: tmoe.FusedMoE(6, K, N, 2, num_expert_group=4, topk_group=2), ValueError,
        "num_expert_group=4 must divide num_experts=6"),
    Row("warmup-topk", lambda: tmoe.FusedMoE(4, K, N, 2, dtype=torch.float32).kernel.warmup(
        4, torch.randn(4, 2 * N, K), torch.randn(4, K, N), 5, dtype=torch.float32), ValueError,
        r"topk must be in \[1, num_experts=4\]"),
    Row("warmup-float32-no-dtype", lambda: tmoe.FusedMoE(4, K, N, 2, dtype=torch.float32).kernel.warmup(
        4, torch.randn(4, 2 * N, K), torch.randn(4, K, N), 2), TypeError, "pass dtype=torch.float32"),
    Row("from_experts-empty", lambda: tmoe.FusedMoE.from_experts([], [], [], 2), ValueError,
        "from_experts needs at least one expert"),
    Row("replace_moe_blocks-dict", lambda: __import__("tmoe.integrations.transformers", fromlist=["x"])
        .replace_moe_blocks({}), TypeError, "model must be a torch.nn.Module"),
    Row("batched-capacity-zero", lambda: tmoe.BatchedPrepareAndFinalize(0, 2), ValueError, "max_num_tokens"),
    Row("batched-capacity-mismatch", _modular(lambda: tmoe.BatchedPrepareAndFinalize(6, 2),
                                              lambda: tmoe.BatchedTritonExperts(8)), ValueError, "capacity"),
    Row("batched-format-mismatch", _modular(tmoe.NoEPPrepareAndFinalize, lambda: tmoe.BatchedTritonExperts(8)),
        ValueError, "Standard"),
    Row("batched-local-experts-mismatch", _subprocess(_BATCHED_WRONG_EXPERTS), ValueError,
        r"num_local_experts=2\) does not match the 4 experts"),
    Row("stage-block_m-mismatch", _stage_block_m_mismatch, ValueError, "block_m=32"),
    Row("stage-int4-float-weights", _stage_low_bit(w1=lambda p, a: p.w1), TypeError, "w1 must have dtype in .*uint8"),
    Row("stage-int4-odd-k", _stage_low_bit(x=lambda p, a: p.x[:, : K - 1]), ValueError,
        r"int4 packs 2 values per byte along w1's last dimension for hidden_states \(\.\.\., K=63\): K_in=63 must be"),
    Row("stage-int4-missing-scale", _stage_low_bit(w_scale=None), ValueError, "int4 experts need w_scale"),
    Row("stage-int4-a_scale", _stage_low_bit(a_scale=lambda p, a: torch.ones(1, device=DEVICE)), ValueError,
        "a_scale is an fp8 activation scale; int4 weights keep hidden_states unquantized"),
    Row("stage-zp-without-scheme", _stage_low_bit(w1=lambda p, a: p.w1, w_scale=None, weight_dtype=None, group_size=0),
        ValueError, "w_zp is the zero points of int4/int8 weights"),
    Row("stage-unknown-weight_dtype", _stage_low_bit(weight_dtype="int3"), ValueError,
        "weight_dtype must be None or one of"),
    Row("hidden_states-cpu-off-interpreter", _cpu_tensors_off_interpreter, ValueError,
        "hidden_states is on the CPU, where tmoe's kernels do not run here"),
    Row("align-block-not-pow2", lambda: tmoe.moe_align_block_size(_p().topk_ids, 24, E), ValueError, "block_size"),
    Row("route-topk-too-large", lambda: tmoe.topk_route(torch.randn(3, 4, device=DEVICE), 5), ValueError, "topk"),
    Row("route-group-alone", lambda: tmoe.topk_route(torch.randn(3, 4, device=DEVICE), 2, num_expert_group=2),
        ValueError, "together"),
    Row("quant-group-not-dividing", lambda: tmoe.per_token_group_quant_fp8(torch.randn(3, 100, device=DEVICE), 64),
        ValueError, "group_size"),
    Row("static-quant-scale-shape", lambda: tmoe.static_quant_fp8(torch.randn(3, 64, device=DEVICE),
                                                                  torch.ones(2, device=DEVICE)), ValueError, "scale"),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input_raises_clear_error(row: Row):
    with pytest.raises(row.error, match=row.match):
        row.call()


def test_cli_help_prints_usage():
    run = subprocess.run([sys.executable, "-m", "tmoe", "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "usage: python -m tmoe" in run.stdout


def test_documented_results():
    """Rows whose documented result is not an error: out-of-range ids contribute exactly 0,
    M = 0 gives an empty output."""
    p = make_problem(MoEShape(M, E, N, K, TOPK), torch.float32, "out_of_range", seed=7, device=DEVICE)
    out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
    assert_close(out, moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids), torch.float32)
    empty = make_problem(MoEShape(0, E, N, K, TOPK), torch.float32, "uniform", seed=7, device=DEVICE)
    assert tmoe.fused_experts(empty.x, empty.w1, empty.w2, empty.topk_weights, empty.topk_ids).shape == (0, K)


def test_every_row_is_documented():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "bad_inputs.md").read_text()
    listed = set(re.findall(r"^\| `([^`]+)` \|", doc, flags=re.M))
    tested = {r.id for r in ROWS} | {"cli-help", "out-of-range-ids", "zero-tokens"}
    assert tested <= listed, f"rows missing from docs/bad_inputs.md: {sorted(tested - listed)}"
