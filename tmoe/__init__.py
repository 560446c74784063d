"""tmoe: pure-Triton Mixture-of-Experts kernels as torch.library custom ops.

Stages: ``moe_align_block_size`` -> ``moe_gemm_up`` (up/gate + activation) -> ``moe_gemm_down``
-> ``moe_reduce``, composed by ``fused_experts`` and the modular kernel.
"""
import os as _os

import torch as _torch

if not _torch.cuda.is_available():
    # Triton has no CPU backend: without a GPU the kernels run under its interpreter (set before
    # any @triton.jit is defined; an explicit TRITON_INTERPRET wins).
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from tmoe import ops as _ops  # noqa: F401  (registers torch.ops.tmoe.*)
from tmoe.config import GemmConfig, MoEConfig, get_config, override_config, override_route
from tmoe.distributed import AllGatherPrepareAndFinalize
from tmoe.experts import BatchedTritonExperts, TritonExperts
from tmoe.fused import fused_experts
from tmoe.kernels.align import moe_align_block_size
from tmoe.kernels.quant import per_token_group_quant_fp8, per_token_quant_fp8, static_quant_fp8
from tmoe.kernels.reduce import moe_reduce
from tmoe.kernels.router import topk_route
from tmoe.modular import (
    FusedMoEActivationFormat,
    FusedMoEPermuteExpertsUnpermute,
    FusedMoEPrepareAndFinalize,
    FusedMoEQuantConfig,
    PrepareResult,
)
from tmoe.layer import FusedMoE
from tmoe.modular_kernel import FusedMoEModularKernel
from tmoe.quant_weights import (
    quantize_weight_per_block_fp8,
    quantize_weight_per_channel_fp8,
    quantize_weight_per_tensor_fp8,
)
from tmoe.prepare_finalize import BatchedPrepareAndFinalize, NoEPPrepareAndFinalize

__all__ = [
    "AllGatherPrepareAndFinalize", "BatchedPrepareAndFinalize", "BatchedTritonExperts", "FusedMoE", "FusedMoEActivationFormat", "FusedMoEModularKernel",
    "FusedMoEPermuteExpertsUnpermute", "FusedMoEPrepareAndFinalize", "FusedMoEQuantConfig", "GemmConfig",
    "MoEConfig", "NoEPPrepareAndFinalize", "PrepareResult", "TritonExperts", "fused_experts", "get_config",
    "moe_align_block_size", "moe_reduce", "override_config", "override_route", "per_token_group_quant_fp8", "per_token_quant_fp8",
    "quantize_weight_per_block_fp8", "quantize_weight_per_channel_fp8", "quantize_weight_per_tensor_fp8",
    "static_quant_fp8", "topk_route",
]
