"""distrib's CUDA collectives against raw cupy.cuda.nccl on the same buffers, in the nccl-tests output format.

python3 bench/nccl_bench.py                       # all GPUs, 4 B to 256 MB, then the batch and kernel benchmarks
python3 bench/nccl_bench.py -b 8 -e 128M -f 2 -n 50

Three measurements, each printed with its target and PASS/FAIL:

1. all_reduce (float32 SUM) through `CudaBackend.all_reduce` vs raw `NcclCommunicator.allReduce` on the same
   buffers. Raw is timed twice: back to back with one synchronisation at the end (as nccl-tests does), and
   synchronised after every call (distrib waits for each collective under its watchdog). Targets: distrib at most
   5 % slower than raw back-to-back at >= 64 MB, and at most 30 us per call at 4 B.
2. `StrategyExtended.batch_reduce_to` of 1,000 arrays of 256 float32: packed (NcclAllReduce(num_packs=1)) vs one
   NCCL call per array (num_packs=0). Target: packed at least 10x faster.
3. The pack and unpack kernels moving 64 MB (1,000 members, then 4) vs a device-to-device copy of 64 MB.
   Target: at least 80 % of the copy's bandwidth.

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

COLUMN = "     time   algbw   busbw  #wrong"
COLUMN_UNITS = "     (us)  (GB/s)  (GB/s)        "


def header(groups: int) -> str:
    """nccl-tests' two header lines, with `groups` column groups (nccl-tests has out-of-place and in-place)."""
    return ("#       size         count      type   redop    root" + COLUMN * groups + "\n"
            + ("#        (B)    (elements)".ljust(52) + COLUMN_UNITS * groups).rstrip())


BATCH_COUNT, BATCH_ELEMENTS = 1000, 256
KERNEL_BYTES = 64 << 20


def size_arg(text: str) -> int:
    match = re.fullmatch(r"(\d+)([KMG]?)", text.strip().upper())
    if not match:
        raise argparse.ArgumentTypeError(f"a size such as 8, 64K, 128M or 1G. Received: {text!r}")
    return int(match[1]) << {"": 0, "K": 10, "M": 20, "G": 30}[match[2]]


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
    out, size = [], max(4, args.minbytes // 4 * 4)
    while size <= args.maxbytes:
        out.append(size)
        size *= max(2, args.stepfactor)
    return out


def row(size: int, count: int, root: int, n: int, columns: list[tuple[float, int] | None]) -> str:
    """One nccl-tests line: (time in us, wrong count) per column pair, or None for N/A."""
    text = f"{size:12d}  {count:12d}  {'float':>8s}  {'sum':>6s}  {root:6d}"
    for column in columns:
        if column is None:
            text += f"  {'N/A':>7s}  {'N/A':>6s}  {'N/A':>6s}  {'N/A':>6s}"
            continue
        us, wrong = column
        algbw = size / us / 1e3
        busbw = algbw * 2 * (n - 1) / n
        text += f"  {us:7.2f}  {algbw:6.2f}  {busbw:6.2f}  {wrong:6d}"
    return text


def all_reduce_rows(args, cupy, nccl, backend, devices, ordinals) -> list[dict]:
    n = len(devices)
    comms = nccl.NcclCommunicator.initAll(list(ordinals))
    streams = [backend._stream(o) for o in ordinals]
    results = []
    print(f"# all_reduce, float32 sum, {n} GPU(s): raw cupy.cuda.nccl back to back | raw synchronised per call | "
          f"distrib CudaBackend.all_reduce\n{header(3)}")
    for size in sizes(args):
        count = size // 4
        sends, recvs = [], []
        for k, o in enumerate(ordinals):
            with cupy.cuda.Device(o), streams[k]:
                sends.append(cupy.full(count, k + 1, np.float32))
                recvs.append(cupy.empty(count, np.float32))
        expected = n * (n + 1) / 2

        def raw_once(in_place=False):
            nccl.groupStart()
            for k, (o, comm) in enumerate(zip(ordinals, comms)):
                with cupy.cuda.Device(o):
                    target = sends[k] if in_place else recvs[k]
                    comm.allReduce(sends[k].data.ptr, target.data.ptr, count, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                                   streams[k].ptr)
            nccl.groupEnd()

        def sync():
            for s in streams:
                s.synchronize()

        def timed(step, per_call_sync):
            for _ in range(args.warmup_iters):
                step()
            sync()
            samples = []
            start = time.perf_counter()
            for _ in range(args.iters):
                t0 = time.perf_counter()
                step()
                if per_call_sync:
                    sync()
                samples.append(time.perf_counter() - t0)
            sync()
            total = (time.perf_counter() - start) / args.iters
            return (statistics.median(samples) if per_call_sync else total) * 1e6

        raw_us = timed(raw_once, per_call_sync=False)
        raw_wrong = sum(int((r != expected).sum().get()) for r in recvs)
        raw_sync_us = timed(raw_once, per_call_sync=True)
        distrib_us = timed(lambda: backend.all_reduce(sends, [(0, count)], devices, False), per_call_sync=True)
        outs = backend.all_reduce(sends, [(0, count)], devices, False)
        distrib_wrong = sum(int((o != expected).sum().get()) for o in outs)
        print(row(size, count, -1, n, [(raw_us, raw_wrong), (raw_sync_us, raw_wrong), (distrib_us, distrib_wrong)]))
        results.append({"bytes": size, "raw_us": raw_us, "raw_synchronised_us": raw_sync_us, "distrib_us": distrib_us,
                        "wrong": raw_wrong + distrib_wrong})
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
          f"one NCCL call per array {timings['per_array']:.0f} us")
    return timings


def kernel_rows(cupy, backend) -> dict:
    from distrib.backends.cuda_kernels import Kernels

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
        results["copy_GBps"] = 2 * KERNEL_BYTES / copy_us / 1e3
        for members in (1000, 4):
            parts = [cupy.ones(KERNEL_BYTES // 4 // members, np.float32) for _ in range(members)]
            flat = cupy.empty(sum(p.size for p in parts), np.float32)
            for kind, pack in (("pack", True), ("unpack", False)):
                us = gpu_us(lambda: kernels.move(flat, parts, pack=pack))
                results[f"{kind}_{members}_GBps"] = 2 * flat.nbytes / us / 1e3
    print(f"# pack/unpack of 64 MB vs a 64 MB device-to-device copy ({results['copy_GBps']:.0f} GB/s, bytes read + "
          f"written): " + ", ".join(f"{k.removesuffix('_GBps')} {v:.0f} GB/s ({v / results['copy_GBps']:.0%})"
                                    for k, v in results.items() if k != "copy_GBps"))
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

    big = [r for r in rows if r["bytes"] >= 64 << 20]
    small = [r for r in rows if r["bytes"] == 4]
    targets = {
        "all_reduce >= 64 MB at most 5% slower than raw": (
            all(r["distrib_us"] <= 1.05 * r["raw_us"] for r in big) if big else None),
        "all_reduce of 4 B at most 30 us": small[0]["distrib_us"] <= 30 if small else None,
        "batch_reduce_to packed at least 10x faster": batch["per_array"] >= 10 * batch["packed"],
        "pack/unpack at least 80% of copy bandwidth": all(
            v >= 0.8 * kernel["copy_GBps"] for k, v in kernel.items() if k != "copy_GBps"),
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
        "kernels": kernel, "targets": targets}, indent=2) + "\n")
    print(f"# results: {path}")
    return 0 if all(ok is not False for ok in targets.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
