"""The CUDA backend: CuPy arrays, one stream per device, NCCL communicators and the kernel loader.

Only `backend.py` and `nccl.py` import CuPy at module level; the device, dtype and kernel tables import
without it, so they are tested on machines with no GPU.
"""
