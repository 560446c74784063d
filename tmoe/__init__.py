"""tmoe: pure-Triton Mixture-of-Experts kernels as torch.library custom ops.

Stages: ``moe_align_block_size`` -> ``moe_gemm_up`` (up/gate + activation) -> ``moe_gemm_down``
-> ``moe_reduce``, composed by ``fused_experts`` and the modular kernel.
"""
from tmoe import ops as _ops  # noqa: F401  (registers torch.ops.tmoe.*)
from tmoe.config import GemmConfig, MoEConfig, get_config, override_config
from tmoe.experts import BatchedTritonExperts, TritonExperts
from tmoe.fused import fused_experts
from tmoe.kernels.align import moe_align_block_size
from tmoe.kernels.reduce import moe_reduce
from tmoe.modular import (
    FusedMoEActivationFormat,
    FusedMoEPermuteExpertsUnpermute,
    FusedMoEPrepareAndFinalize,
    FusedMoEQuantConfig,
    PrepareResult,
)
from tmoe.modular_kernel import FusedMoEModularKernel
from tmoe.prepare_finalize import BatchedPrepareAndFinalize, NoEPPrepareAndFinalize

__all__ = [
    "BatchedPrepareAndFinalize", "BatchedTritonExperts", "FusedMoEActivationFormat", "FusedMoEModularKernel",
    "FusedMoEPermuteExpertsUnpermute", "FusedMoEPrepareAndFinalize", "FusedMoEQuantConfig", "GemmConfig",
    "MoEConfig", "NoEPPrepareAndFinalize", "PrepareResult", "TritonExperts", "fused_experts", "get_config",
    "moe_align_block_size", "moe_reduce", "override_config",
]
