"""The CUDA backend: CuPy arrays, one stream per device, NCCL communicators and the kernel loader.

`arrays.py`, `backend.py`, `collectives.py`, `multi_process.py`, `nccl.py` and `staging.py` import CuPy at module
level; `devices.py`, `dtypes.py`, `errors.py` (CuPy's exception classes are imported when first translated),
`kernels.py`, `results.py` and `watchdog.py` import without it, so they are tested on machines with no GPU.
"""
