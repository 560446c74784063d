"""Jit helpers shared by several stages (private): activations, tile matmuls, low-bit dequantization, the GEMM epilogue."""
