"""Attention over the paged KV cache: torch reference and Triton kernels."""
