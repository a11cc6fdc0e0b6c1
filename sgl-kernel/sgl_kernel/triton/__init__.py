"""Triton kernels. Every module here imports `triton` at import time: import them only after
checking `sgl_kernel.triton_available()`, and set TRITON_INTERPRET=1 before importing to run
them on CPU."""
