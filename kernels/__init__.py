"""The CUDA C sources of distrib's kernels (*.cu, *.cuh), installed as the package distrib.kernels."""
