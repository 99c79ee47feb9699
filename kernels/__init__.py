"""Triton kernels and their launchers, one op per file (installed as transformer_fast.kernels)."""
