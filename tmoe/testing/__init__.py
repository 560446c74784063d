"""Testing helpers for MoE code: hypothesis strategies, tolerances against ``tmoe.reference``,
and the Triton-interpreter workarounds used on CPU.

``tmoe.testing.strategies`` needs ``hypothesis`` (the ``test`` extra)."""
from tmoe.testing.interpreter import patch_interpreter
from tmoe.testing.tolerance import TOLERANCES, Tolerance, assert_close, poison, rel_error

__all__ = ["TOLERANCES", "Tolerance", "assert_close", "patch_interpreter", "poison", "rel_error"]
