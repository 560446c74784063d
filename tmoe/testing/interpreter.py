"""Process-wide use of tmoe's Triton-interpreter workarounds (``tmoe/runtime/interpreter.py``).

tmoe's own launches apply them by themselves, for the duration of each launch; call
``patch_interpreter`` only to have your own ``@triton.jit`` kernels computed the same way."""
from tmoe.runtime.interpreter import install_interpreter_fixes as patch_interpreter

__all__ = ["patch_interpreter"]
