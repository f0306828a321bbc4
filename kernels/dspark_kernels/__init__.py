"""Triton kernels for DeepSeek-V4's variable-length (ragged) verify path, each with a torch
reference that reproduces SGLang 0.5.23's CUDA kernels. See `kernels/README.md`."""
