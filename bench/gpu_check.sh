#!/usr/bin/env bash
# Every GPU test and GPU benchmark in one command, every output in one folder.
#
#   bench/gpu_check.sh [OUT_DIR]          # default bench/results/gpu-<date>-<gpu>/
#
# On a machine without internet, first run bench/gpu_wheels.sh where PyPI is reachable and bring wheels/ along:
# this script installs wheels/*.whl without an index, then the checkout in editable mode.
# Steps, each logged to OUT_DIR/<step>.txt, with summary.txt saying PASS/FAIL per step and the exit status the
# number of failed steps: the GPU and library versions; the GPU tests; the whole suite with the CUDA backend
# active; nccl_bench (collectives, batches, kernels and strategy.run against raw NCCL and the peers, with
# targets); input_bench --gpu (host-to-device input against raw pinned copies); `distrib train` on the GPUs.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | tr -cs 'A-Za-z0-9' '-' | sed 's/-$//')
out="${1:-bench/results/gpu-$(date +%F)-${gpu:-no-gpu}}"
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
failed=0

step() {  # step NAME COMMAND...: runs COMMAND, logs it to OUT/NAME.txt, records PASS/FAIL and the time taken
  local name="$1"
  shift
  local start=$SECONDS
  echo "== $name: $*"
  if "$@" >"$out/$name.txt" 2>&1; then
    echo "PASS  $name  ($((SECONDS - start)) s)" | tee -a "$summary"
  else
    echo "FAIL  $name  ($((SECONDS - start)) s, exit $?): see $out/$name.txt" | tee -a "$summary"
    tail -n 20 "$out/$name.txt"
    failed=$((failed + 1))
  fi
}

if compgen -G "wheels/*.whl" >/dev/null; then
  step install bash -c 'python3 -m pip install -q --no-deps --no-index wheels/*.whl &&
                        python3 -m pip install -q --no-deps --no-build-isolation -e .'
fi
step versions bash -c 'nvidia-smi && python3 -m distrib info'
step gpu-tests python3 -m pytest -q -m gpu -p no:cacheprovider --junitxml="$out/gpu-tests.xml" tests
step full-suite python3 -m pytest -q -p no:cacheprovider tests
step nccl-bench python3 bench/nccl_bench.py --json "$out/nccl_bench.json"
step input-bench python3 bench/input_bench.py --gpu --json "$out/input_bench.json"
step train python3 -m distrib train --epochs 20 --out "$out/train-run"
echo "results in $out; $failed step(s) failed"
exit "$failed"
