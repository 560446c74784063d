"""tmoe: pure-Triton Mixture-of-Experts kernels as torch.library custom ops.

Stages: ``moe_align_block_size`` -> ``moe_gemm_up`` (up/gate + activation) -> ``moe_gemm_down``
-> ``moe_reduce``, composed by ``fused_experts`` and the modular kernel. Layout, lowest first:
kernels < config < modular < ops < face (this package's top level, integrations); tools and
testing sit beside the library and are never imported by it.
"""
from tmoe.runtime.interpreter import interpreted_definitions as _interpreted_definitions

with _interpreted_definitions():  # no GPU: tmoe's @triton.jit kernels are interpreted, nobody else's
    from tmoe import ops as _ops  # noqa: F401  (registers torch.ops.tmoe.*; imports every kernel)
from tmoe.config import (  # noqa: E402
    GemmConfig, MoEConfig, batch_invariant, get_config, override_config, override_pdl, override_route,
)
from tmoe.fused import fused_experts  # noqa: E402
from tmoe.layer import FusedMoE, FusedMoEModularKernel  # noqa: E402
from tmoe.modular import (  # noqa: E402
    AllGatherPrepareAndFinalize,
    AllToAllPrepareAndFinalize,
    BatchedPrepareAndFinalize,
    BatchedTritonExperts,
    ExpertParallel,
    FusedMoEActivationFormat,
    FusedMoEPermuteExpertsUnpermute,
    FusedMoEPrepareAndFinalize,
    FusedMoEQuantConfig,
    NoEPPrepareAndFinalize,
    PrepareResult,
    TritonExperts,
)
from tmoe.functional import (  # noqa: E402
    moe_align_block_size, moe_reduce, per_token_group_quant_fp8, per_token_quant_fp8, static_quant_fp8, topk_route,
)
from tmoe.weights import (  # noqa: E402
    mxfp4_from_blocks,
    quantize_weight_int4,
    quantize_weight_int8,
    quantize_weight_mxfp4,
    quantize_weight_per_block_fp8,
    quantize_weight_per_channel_fp8,
    quantize_weight_per_tensor_fp8,
)

__all__ = [
    "AllGatherPrepareAndFinalize", "AllToAllPrepareAndFinalize", "BatchedPrepareAndFinalize", "BatchedTritonExperts",
    "ExpertParallel", "FusedMoE", "FusedMoEActivationFormat", "FusedMoEModularKernel", "FusedMoEPermuteExpertsUnpermute",
    "FusedMoEPrepareAndFinalize", "FusedMoEQuantConfig", "GemmConfig", "MoEConfig", "NoEPPrepareAndFinalize",
    "PrepareResult", "TritonExperts", "batch_invariant", "fused_experts", "get_config", "moe_align_block_size", "moe_reduce",
    "mxfp4_from_blocks", "override_config", "override_pdl", "override_route", "per_token_group_quant_fp8",
    "per_token_quant_fp8",
    "quantize_weight_int4", "quantize_weight_int8", "quantize_weight_mxfp4", "quantize_weight_per_block_fp8", "quantize_weight_per_channel_fp8", "quantize_weight_per_tensor_fp8",
    "static_quant_fp8", "topk_route",
]
