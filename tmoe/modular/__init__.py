"""The modular MoE kernel: interfaces, their Triton implementations, expert parallelism, and the
composition as a value (``KernelSpec`` -> ``ModularKernel``). No torch.library here: the layer
op in ``tmoe.ops`` rebuilds a ModularKernel from its spec."""
from tmoe.modular.alltoall import AllToAllPrepareAndFinalize
from tmoe.modular.call import LayerArgs
from tmoe.modular.distributed import AllGatherPrepareAndFinalize
from tmoe.modular.experts import BatchedTritonExperts, TritonExperts
from tmoe.modular.expert_parallel import ExpertParallel
from tmoe.modular.interfaces import (
    ExpertsCall, FusedMoEActivationFormat, FusedMoEPermuteExpertsUnpermute, FusedMoEPrepareAndFinalize, PrepareResult,
    Route,
)
from tmoe.modular.kernel import KernelSpec, ModularKernel, build
from tmoe.modular.placement import PLACEMENTS, expert_map, local_expert_ids, shard_experts
from tmoe.modular.prepare_finalize import BatchedPrepareAndFinalize, NoEPPrepareAndFinalize
from tmoe.modular.problem import MoEProblem
from tmoe.modular.quant_config import FusedMoEQuantConfig

__all__ = [
    "AllGatherPrepareAndFinalize", "AllToAllPrepareAndFinalize", "BatchedPrepareAndFinalize", "BatchedTritonExperts",
    "ExpertParallel", "ExpertsCall", "FusedMoEActivationFormat", "FusedMoEPermuteExpertsUnpermute", "FusedMoEPrepareAndFinalize",
    "FusedMoEQuantConfig", "KernelSpec", "LayerArgs", "ModularKernel", "MoEProblem", "NoEPPrepareAndFinalize", "PLACEMENTS",
    "PrepareResult", "Route", "TritonExperts", "build", "expert_map", "local_expert_ids", "shard_experts",
]
