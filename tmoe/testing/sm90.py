"""Compile Triton kernels for Hopper (sm_90) without a GPU, to read what the compiler makes of them
(PTX, TTGIR, cubin; ``sass`` disassembles a cubin): a stand-in CUDA driver reports an sm_90 device,
and every JIT launch only compiles (``warmup``), so nothing runs. For tests and probes; once per
process, before any launch."""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable

import triton


def compile_only_sm90(on_compile: Callable[[str, dict, Any], None]) -> None:
    """Make the active Triton driver an sm_90 stand-in and every launch compile-only, calling
    ``on_compile(kernel name, launch keyword arguments, CompiledKernel)`` for each (the compiled
    kernel's ``asm`` holds "ttgir", "ptx" and "cubin")."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    class Sm90(CudaDriver):
        def __init__(self):
            self.get_current_device = lambda: 0
            self.get_current_stream = lambda device=None: 0
            self.get_device_capability = lambda device=None: (9, 0)

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    driver.set_active(Sm90())
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        on_compile(self.fn.__name__, kwargs, kernel)
        return kernel

    JITFunction.run = compile_only


def sass(cubin: bytes) -> str:
    """The SASS and resource usage (registers: ``REG:n``) of a compiled kernel's cubin, from the
    cuobjdump that Triton's NVIDIA backend ships (no CUDA toolkit needed)."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(cuobjdump), "--dump-resource-usage", "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
