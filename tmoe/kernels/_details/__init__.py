"""Jit helpers of the stages (private): shared ones (activations, tile matmuls, low-bit dequantization, the GEMM
epilogue) and the align stage's building blocks."""
