"""Testing helpers for MoE code: hypothesis strategies, tolerances against ``tmoe.reference``,
and (for your own kernels) the Triton-interpreter workarounds tmoe applies to its launches.

``tmoe.testing.strategies`` needs ``hypothesis`` (the ``test`` extra)."""
from tmoe.testing.graphs import capture_cuda_graph
from tmoe.testing.interpreter import patch_interpreter
from tmoe.testing.record_ops import RecordOps
from tmoe.testing.tolerance import TOLERANCES, Tolerance, assert_close, poison, rel_error

__all__ = ["RecordOps", "TOLERANCES", "Tolerance", "assert_close", "capture_cuda_graph", "patch_interpreter", "poison", "rel_error"]
