"""Kernels and numerics: MXFP8/FP8 quantization, Triton grouped GEMM and permute kernels, quantized experts.

Triton is imported only by the modules that define kernels, so ``import moebench.kernels`` stays light.
"""
