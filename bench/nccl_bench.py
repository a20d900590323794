"""distrib's CUDA path against raw cupy.cuda.nccl and the peers, in one run, in the nccl-tests output format.

python3 bench/nccl_bench.py                       # all GPUs, 4 B to 256 MB, then batch, kernel and strategy rows
python3 bench/nccl_bench.py -b 8 -e 128M -f 2 -n 50

Every target is a ratio to a baseline timed in the same run (the issue "The CUDA path, proven on a real GPU"):

1. all_reduce (float32 SUM) through `CudaBackend.all_reduce` against raw `NcclCommunicator.allReduce` on the same
   buffers. Back to back (one synchronisation at the end, GPU time from CUDA events, as nccl-tests times):
   raw out-of-place, raw in-place and distrib; target distrib at most 5 % over raw out-of-place at >= 64 MB.
   Synchronised after every call (host clock; completion polled, as nccl-tests waits): raw, distrib, and the peers
   where installed, `cupyx.distributed`'s NCCL backend and `torch.distributed` (NCCL, one rank); target distrib at
   most raw + 4 us at 4 B.
2. `StrategyExtended.batch_reduce_to` of 1,000 arrays of 256 float32: packed (NcclAllReduce(num_packs=1)) against
   one NCCL call per array (num_packs=0). Target: packed at least 50x faster.
3. The pack and unpack kernels moving 64 MB (1,000 members, then 4) against a device-to-device copy of 64 MB.
   Target: at least 80 % of the copy's bandwidth for the kernel launched with its table ready (as the unpack into
   reused outputs launches it). Printed beside it: the same with the table built for every call (as a pack of new
   gradients is), and the host time that takes.
4. `strategy.run` with one `all_reduce` of 1M float32 on 1 replica (target at most 60 us per step), and 4 replicas
   sharing GPU:0 with a batched `all_reduce` of 200 x 1,000 float32 (target at most 1,000 us per step), each
   step synchronised.

Results go to bench/results/nccl-<date>-<gpu>.json with the date, the GPU, the driver and library versions.
Without a GPU it says what is missing and exits with status 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))  # benchmark the checkout this file belongs to, installed or not

from distrib.backends.cuda.watchdog import wait_for  # noqa: E402
from measure import per_step_us  # noqa: E402 - bench/measure.py, the benchmarks' shared timing loop
from distrib.cli.bench.table import COLLECTIVES, Cell, bandwidths, header, parse_size  # noqa: E402
from distrib.cli.bench.table import row as table_row  # noqa: E402
from distrib.cli.bench.table import sizes as size_sweep  # noqa: E402

ALL_REDUCE = COLLECTIVES["all_reduce"]

BATCH_COUNT, BATCH_ELEMENTS = 1000, 256
KERNEL_BYTES = 64 << 20
STRATEGY_VECTOR = 1 << 20  # strategy rows: one all_reduce of this many float32 on 1 replica
STRATEGY_BATCH = (4, 200, 1000)  # replicas sharing GPU:0, arrays, float32 elements each


def size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-b", "--minbytes", type=size_arg, default=4, help="smallest all_reduce size (default 4)")
    parser.add_argument("-e", "--maxbytes", type=size_arg, default=256 << 20, help="largest size (default 256M)")
    parser.add_argument("-f", "--stepfactor", type=int, default=4, help="size multiplier between rows (default 4)")
    parser.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per row (default 20)")
    parser.add_argument("-w", "--warmup_iters", type=int, default=5, help="untimed iterations first (default 5)")
    parser.add_argument("--json", type=Path, default=None, help="where to write results (default bench/results/)")
    return parser.parse_args(argv)


def sizes(args) -> list[int]:
    return size_sweep(max(4, args.minbytes // 4 * 4), args.maxbytes, max(2, args.stepfactor))


def row(size: int, n: int, columns: list[tuple[float, int]]) -> str:
    """One nccl-tests line of a float32 sum all-reduce: (time in us, wrong count) per column group."""
    return table_row(ALL_REDUCE, ALL_REDUCE.layout(size, 4, n), "float", "sum", -1, n,
                     [Cell(us, wrong) for us, wrong in columns])


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def peers(cupy, n: int) -> dict:
    """One-rank all-reduce callables of the peers installed here: name -> (send, recv) -> None, or a reason."""
    found: dict = {}
    if n != 1:
        return {"note": "the peers are timed on one GPU only (one process, one rank)"}
    try:
        from cupyx.distributed import init_process_group

        comm = init_process_group(1, 0, backend="nccl", host="127.0.0.1", port=free_port())
        found["cupyx.distributed"] = lambda send, recv: comm.all_reduce(send, recv, "sum")
    except Exception as exc:  # a peer that cannot start is reported, not fatal
        found["cupyx.distributed"] = f"unavailable: {type(exc).__name__}: {exc}"
    try:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        tensors: dict = {}

        def torch_all_reduce(send, recv):  # in place on its own tensor: torch has no out-of-place all_reduce
            key = send.data.ptr
            if key not in tensors:
                tensors[key] = torch.as_tensor(recv, device=f"cuda:{recv.device.id}")
            dist.all_reduce(tensors[key])

        found["torch.distributed"] = torch_all_reduce
    except Exception as exc:
        found["torch.distributed"] = f"unavailable: {type(exc).__name__}: {exc}"
    return found


def all_reduce_rows(args, cupy, nccl, backend, devices, ordinals) -> list[dict]:
    n = len(devices)
    comms = nccl.NcclCommunicator.initAll(list(ordinals))
    streams = [backend._stream(o) for o in ordinals]
    peer_calls = peers(cupy, n)
    peer_names = [name for name, call in peer_calls.items() if callable(call)]
    results = []
    for name, call in peer_calls.items():
        if not callable(call):
            print(f"# peer {name}: {call}")
    print(f"# all_reduce, float32 sum, {n} GPU(s), back to back, GPU time from CUDA events: raw cupy.cuda.nccl "
          f"out-of-place | raw in-place | distrib CudaBackend.all_reduce\n"
          f"{header(['raw out-of-place', 'raw in-place', 'distrib'])}")
    latency_lines = []
    for size in sizes(args):
        count = size // 4
        sends, recvs, in_place = [], [], []
        for k, o in enumerate(ordinals):
            with cupy.cuda.Device(o), streams[k]:
                sends.append(cupy.full(count, k + 1, np.float32))
                recvs.append(cupy.empty(count, np.float32))
                in_place.append(cupy.full(count, k + 1, np.float32))
        expected = n * (n + 1) / 2

        def raw_once(targets=None):
            nccl.groupStart()
            for k, (o, comm) in enumerate(zip(ordinals, comms)):
                with cupy.cuda.Device(o):
                    source = sends[k] if targets is None else targets[k]
                    target = recvs[k] if targets is None else targets[k]
                    comm.allReduce(source.data.ptr, target.data.ptr, count, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                                   streams[k].ptr)
            nccl.groupEnd()

        def sync():  # polled, as nccl-tests waits: a blocking wait took 2.4 ms to wake on 2026-11-27's H200
            wait_for(streams)

        def back_to_back(step) -> float:
            """GPU time per call of `step` issued args.iters times without waiting, from events on every stream."""
            for _ in range(args.warmup_iters):
                step()
            sync()
            starts, ends = [], []
            for o, s in zip(ordinals, streams):
                with cupy.cuda.Device(o):
                    starts.append(cupy.cuda.Event())
                    ends.append(cupy.cuda.Event())
                    starts[-1].record(s)
            for _ in range(args.iters):
                step()
            for o, s, end in zip(ordinals, streams, ends):
                with cupy.cuda.Device(o):
                    end.record(s)
            sync()
            return max(cupy.cuda.get_elapsed_time(a, b) for a, b in zip(starts, ends)) * 1e3 / args.iters

        devices_of = [cupy.cuda.Device(o) for o in ordinals]

        def device_sync():  # ours and the legacy default stream, which the peers (cupyx, torch) queue on, polled
            events = []
            for stream, d in zip(streams, devices_of):
                with d:
                    events += [stream.record(cupy.cuda.Event(disable_timing=True)),
                               cupy.cuda.Stream.null.record(cupy.cuda.Event(disable_timing=True))]
            wait_for(events)

        def synchronised(step) -> float:
            """Host time of one call and the device-wide synchronisation after it: median over args.iters."""
            for _ in range(args.warmup_iters):
                step()
                device_sync()
            samples = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                step()
                device_sync()
                samples.append(time.perf_counter() - t0)
            return statistics.median(samples) * 1e6

        def distrib_once():
            return backend.all_reduce(sends, [(0, count)], devices, False)

        raw_us = back_to_back(raw_once)
        raw_wrong = sum(int((r != expected).sum().get()) for r in recvs)
        for k, target in enumerate(in_place):  # in place sums the previous result: reset, then check one call
            target.fill(k + 1)
        raw_once(in_place)
        sync()
        in_place_wrong = sum(int((t != expected).sum().get()) for t in in_place)
        in_place_us = back_to_back(lambda: raw_once(in_place))
        distrib_us = back_to_back(distrib_once)
        outs = distrib_once()
        sync()
        distrib_wrong = sum(int((o != expected).sum().get()) for o in outs)
        print(row(size, n, [(raw_us, raw_wrong), (in_place_us, in_place_wrong), (distrib_us, distrib_wrong)]))
        latency = {"raw": synchronised(raw_once), "distrib": synchronised(distrib_once)}
        for name in peer_names:
            latency[name] = synchronised(lambda: peer_calls[name](sends[0], recvs[0]))
        latency_lines.append(f"{size:12d}" + "".join(f"  {us:{max(10, len(name))}.2f}" for name, us in latency.items()))
        results.append({"bytes": size, "raw_us": raw_us, "raw_in_place_us": in_place_us, "distrib_us": distrib_us,
                        "synchronised_us": latency, "wrong": raw_wrong + in_place_wrong + distrib_wrong})
    names = ["raw", "distrib", *peer_names]
    print("# all_reduce synchronised after every call, host clock, median us per call:\n#       size"
          + "".join(f"  {name:>{max(10, len(name))}s}" for name in names))
    print("\n".join(latency_lines))
    busbw = [bandwidths(ALL_REDUCE, ALL_REDUCE.layout(r["bytes"], 4, n), r["distrib_us"] / 1e6, n)[1] for r in results]
    print(f"# Avg bus bandwidth (distrib, back to back): {statistics.mean(busbw):.3f} GB/s")
    for comm in comms:
        comm.destroy()
    return results


def batch_rows(cupy, distrib) -> dict:
    timings = {}
    for label, num_packs in (("packed", 1), ("per_array", 0)):
        strategy = distrib.MirroredStrategy(cross_device_ops=distrib.NcclAllReduce(num_packs=num_packs))
        values = [strategy.experimental_distribute_values_from_function(
            lambda ctx: cupy.full(BATCH_ELEMENTS, 1, np.float32)) for _ in range(BATCH_COUNT)]
        pairs = [(v, v) for v in values]
        for _ in range(3):
            strategy.extended.batch_reduce_to("SUM", pairs)
        samples = []
        for _ in range(10):
            start = time.perf_counter()
            strategy.extended.batch_reduce_to("SUM", pairs)
            strategy.extended._backend.synchronize()
            samples.append(time.perf_counter() - start)
        timings[label] = statistics.median(samples) * 1e6
    print(f"# batch_reduce_to of {BATCH_COUNT} x {BATCH_ELEMENTS} float32: packed {timings['packed']:.0f} us, "
          f"one NCCL call per array {timings['per_array']:.0f} us ({timings['per_array'] / timings['packed']:.1f}x)")
    return timings


def kernel_rows(cupy, backend) -> dict:
    from distrib.backends.cuda.kernels import Kernels

    kernels = Kernels()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    results = {}
    with backend.device_scope("GPU:0"):
        stream = backend._stream(0)

        def gpu_us(step, repeats=20):
            step()
            start.record(stream)
            for _ in range(repeats):
                step()
            end.record(stream)
            end.synchronize()
            return cupy.cuda.get_elapsed_time(start, end) * 1e3 / repeats

        source, target = cupy.ones(KERNEL_BYTES // 4, np.float32), cupy.empty(KERNEL_BYTES // 4, np.float32)
        copy_us = gpu_us(lambda: target.data.copy_from_device_async(source.data, KERNEL_BYTES, stream))
        results["copy_GBps"] = copy = 2 * KERNEL_BYTES / copy_us / 1e3
        lines = []
        for members in (1000, 4):
            parts = [cupy.ones(KERNEL_BYTES // 4 // members, np.float32) for _ in range(members)]
            flat = cupy.empty(sum(p.size for p in parts), np.float32)
            for kind, pack in (("pack", True), ("unpack", False)):
                name = f"{kind}_{members}"
                launch = kernels.prepare_move(flat, parts, pack)  # the kernel alone, as a reused unpack launches it
                results[f"{name}_GBps"] = 2 * flat.nbytes / gpu_us(launch) / 1e3
                # and with its table built per call, as a pack of new gradients is: host time per member shows here
                with_table = 2 * flat.nbytes / gpu_us(lambda: kernels.move(flat, parts, pack)) / 1e3
                table_us = per_step_us(lambda: kernels.prepare_move(flat, parts, pack), repeats=5, min_seconds=0.05)
                results |= {f"{name}_with_table_GBps": with_table, f"{name}_table_us": table_us}
                bandwidth = results[f"{name}_GBps"]
                lines.append(f"{name} {bandwidth:.0f} GB/s ({bandwidth / copy:.0%}), with its table built per call "
                             f"{with_table:.0f} GB/s ({with_table / copy:.0%}; the table takes {table_us:.0f} us)")
    print(f"# pack/unpack kernels moving 64 MB vs a 64 MB device-to-device copy ({copy:.0f} GB/s, bytes read + "
          f"written):" + "".join(f"\n#   {line}" for line in lines))
    return results


def strategy_rows(cupy, distrib, backend) -> dict:
    """`strategy.run` + all_reduce per step on the GPU, each step synchronised: 1 replica, and 4 sharing GPU:0."""

    def step_us(strategy, step, args) -> float:
        for _ in range(5):
            strategy.run(step, args=args)
        backend.synchronize()
        samples = []
        for _ in range(50):
            start = time.perf_counter()
            strategy.run(step, args=args)
            backend.synchronize()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples) * 1e6

    def all_reduce(x):
        return distrib.get_replica_context().all_reduce("SUM", x)

    one = distrib.MirroredStrategy(["GPU:0"])
    vector = one.experimental_distribute_values_from_function(
        lambda ctx: cupy.ones(STRATEGY_VECTOR, np.float32))
    replicas, count, elements = STRATEGY_BATCH
    results = {"run_all_reduce_1m_1_replica_us": step_us(one, all_reduce, (vector,))}
    # replica threads (the default, the target's row), and cooperative replicas taking turns on the calling thread
    for execution, key in (("threads", ""), ("cooperative", "_cooperative")):
        shared = distrib.MirroredStrategy(["GPU:0"] * replicas, replica_execution=execution)
        batch = shared.experimental_distribute_values_from_function(
            lambda ctx: [cupy.full(elements, ctx.replica_id_in_sync_group + 1, np.float32) for _ in range(count)])
        results[f"run_batched_200x1000_4_replicas_one_gpu{key}_us"] = step_us(shared, all_reduce, (batch,))
        shared.close()
    print(f"# strategy.run + all_reduce, synchronised per step: 1M float32 on 1 replica "
          f"{results['run_all_reduce_1m_1_replica_us']:.0f} us; {count} x {elements} float32 on {replicas} replicas "
          f"sharing GPU:0 {results['run_batched_200x1000_4_replicas_one_gpu_us']:.0f} us on replica threads, "
          f"{results['run_batched_200x1000_4_replicas_one_gpu_cooperative_us']:.0f} us cooperative")
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    from distrib.backends import cuda_problem, get_backend

    problem = cuda_problem()
    if problem:
        print(f"nccl_bench needs an NVIDIA GPU with CuPy and NCCL, but {problem}.", file=sys.stderr)
        return 2
    import cupy
    from cupy.cuda import nccl

    import distrib

    backend = get_backend("cuda")
    devices = list(backend.default_devices())
    ordinals = list(range(len(devices)))
    gpu = backend.gpus[0].name
    print(f"# distrib nccl_bench: {len(devices)} x {gpu}, CuPy {cupy.__version__}, NCCL {nccl.get_version()}, "
          f"driver {cupy.cuda.runtime.driverGetVersion()}")
    rows = all_reduce_rows(args, cupy, nccl, backend, devices, ordinals)
    batch = batch_rows(cupy, distrib)
    kernel = kernel_rows(cupy, backend)
    runs = strategy_rows(cupy, distrib, backend)

    big = [r for r in rows if r["bytes"] >= 64 << 20]
    small = [r for r in rows if r["bytes"] == 4]
    targets = {
        "all_reduce >= 64 MB at most 5% over raw (back to back)": (
            all(r["distrib_us"] <= 1.05 * r["raw_us"] for r in big) if big else None),
        "all_reduce of 4 B at most raw + 4 us (synchronised per call)": (
            small[0]["synchronised_us"]["distrib"] <= small[0]["synchronised_us"]["raw"] + 4 if small else None),
        "batch_reduce_to packed at least 50x faster than per array": batch["per_array"] >= 50 * batch["packed"],
        "pack/unpack kernels of 1,000 members at least 80% of copy bandwidth": all(
            kernel[f"{kind}_1000_GBps"] >= 0.8 * kernel["copy_GBps"] for kind in ("pack", "unpack")),
        "strategy.run + all_reduce of 1M float32 on 1 replica at most 60 us": (
            runs["run_all_reduce_1m_1_replica_us"] <= 60),
        "4 replicas on one GPU, batched all_reduce of 200 x 1,000 at most 1,000 us": (
            runs["run_batched_200x1000_4_replicas_one_gpu_us"] <= 1000),
        "no wrong results": all(r["wrong"] == 0 for r in rows),
    }
    for name, ok in targets.items():
        print(f"# {'PASS' if ok else 'N/A ' if ok is None else 'FAIL'}  {name}")
    date = datetime.date.today().isoformat()
    path = args.json or BENCH / "results" / f"nccl-{date}-{re.sub(r'[^A-Za-z0-9]+', '-', gpu).strip('-')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "date": date, "gpus": [str(g) for g in backend.gpus], "platform": platform.platform(),
        "cupy": cupy.__version__, "nccl": nccl.get_version(), "driver": cupy.cuda.runtime.driverGetVersion(),
        "settings": vars(args) | {"json": str(args.json)}, "all_reduce": rows, "batch_reduce_to_us": batch,
        "kernels": kernel, "strategy_run_us": runs, "targets": targets}, indent=2) + "\n")
    print(f"# results: {path}")
    return 0 if all(ok is not False for ok in targets.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
