"""Triton kernels, one stage per file; each file holds its ``@triton.jit`` kernels and one launcher."""
