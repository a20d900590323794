"""`distrib bench <collective>`: nccl-tests' flags and table for distrib's collectives, beside the raw baseline,
in one process or across the processes of an `mpirun` job."""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

from distrib.backends.cpu import MAX_REPLICAS
from distrib.cli.bench import memory, report
from distrib.cli.bench.job import Job, device_lines, label as job_label, launched_processes, multi_worker
from distrib.cli.bench.output import Output
from distrib.cli.bench.runners import DistribSeries, NumpySeries, Prepared, RowSpec, count_wrong
from distrib.cli.bench.sweep import TYPES, SweepError, combinations
from distrib.cli.bench.table import COLLECTIVES, Cell, bandwidths, concluded, footer, header, parse_size, row, sizes
from distrib.file_paths import file_in_the_way
from distrib.install_hint import pip_install
from distrib.mpi_env import mpi_environment, reports_for_the_job

BATCH_DEFAULTS = ("4K", "1M")  # -b and -e for batch_reduce: 4 to 1,024 arrays of 1 KiB


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """nccl-tests' flags, with its meanings, and distrib's own (--json, --plot, the batch settings)."""
    parser.error = functools.partial(_usage_error, parser)  # under mpirun, one message rather than one per rank
    parser.add_argument("collective", choices=tuple(COLLECTIVES), help="the collective to measure")
    parser.add_argument("-b", "--minbytes", type=size_argument, default=None,
                        help="smallest size in bytes, K/M/G allowed (default 8; batch_reduce 4K)")
    parser.add_argument("-e", "--maxbytes", type=size_argument, default=None,
                        help="largest size in bytes (default 32M; batch_reduce 1M)")
    parser.add_argument("-i", "--stepbytes", type=size_argument, default=1 << 20,
                        help="increment between sizes when -f is 1 (default 1M)")
    parser.add_argument("-f", "--stepfactor", type=int, default=2,
                        help="multiplication factor between sizes; 1 steps by -i instead (default 2)")
    parser.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size (default 20)")
    parser.add_argument("-w", "--warmup_iters", type=int, default=5, help="untimed iterations first (default 5)")
    parser.add_argument("-c", "--check", type=int, default=1,
                        help="checked iterations per size, each against the host's answer, up to the first with a "
                             "wrong element; 0 prints N/A (default 1)")
    parser.add_argument("-d", "--datatype", default="float", choices=tuple(TYPES) + ("all",),
                        help="element type, or all of nccl-tests' in turn (default float)")
    parser.add_argument("-o", "--op", default="sum",
                        help="sum, avg (distrib's ReduceOp SUM and MEAN), or all in turn (default sum); ignored by "
                             "all_gather and broadcast")
    parser.add_argument("-g", "--ngpus", type=int, default=None,
                        help="devices, one rank each (default: every GPU, or $DISTRIB_CPU_REPLICAS emulated devices); "
                             "under mpirun, each process's emulated devices")
    parser.add_argument("-r", "--root", type=int, default=0,
                        help="root rank of broadcast and reduce, -1 for each in turn (default 0); ignored by the "
                             "others")
    parser.add_argument("--array-bytes", type=size_argument, default=1024,
                        help="batch_reduce: bytes per array (default 1K)")
    parser.add_argument("--bytes-per-pack", default="64K",
                        help="batch_reduce: comma-separated CommunicationOptions.bytes_per_pack values to sweep "
                             "beside packed and per array (default 64K; '' for none)")
    parser.add_argument("--json", metavar="FILE", default=None, help="write the results as JSON")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="plot bus bandwidth against size (.png, .svg, .pdf: any format matplotlib writes)")


def size_argument(text: str) -> int:
    """parse_size for argparse, which shows an ArgumentTypeError's message (a ValueError's it replaces)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _usage_error(parser: argparse.ArgumentParser, message: str) -> None:
    """One line, as every refusal of the command (the usage is under --help); under mpirun, from rank 0 alone."""
    if reports_for_the_job():
        sys.stderr.write(f"{parser.prog}: error: {message}\n")
    raise SystemExit(2)


def _fail(message: str, every_rank: bool = False) -> SystemExit:
    """A user error: one line on stderr, from rank 0 only unless what failed is this rank's own; exit status 2."""
    if every_rank or reports_for_the_job():
        sys.stderr.write(f"distrib bench: error: {message}\n")  # one write: under mpirun every rank's goes to one log
    return SystemExit(2)


def check_arguments(args: argparse.Namespace) -> None:
    """Rejects what distrib cannot measure, saying why (exit status 2, as argparse does), before anything runs."""
    default_b, default_e = BATCH_DEFAULTS if args.collective == "batch_reduce" else ("8", "32M")
    args.minbytes = parse_size(default_b) if args.minbytes is None else args.minbytes
    args.maxbytes = parse_size(default_e) if args.maxbytes is None else args.maxbytes
    for flag, value, low in (("-n", args.iters, 1), ("-w", args.warmup_iters, 0), ("-c", args.check, 0),
                             ("-f", args.stepfactor, 1), ("-r", args.root, -1), ("--array-bytes", args.array_bytes, 1),
                             ("-g", 1 if args.ngpus is None else args.ngpus, 1)):
        if value < low:
            raise _fail(f"{flag} must be at least {low}. Received: {value}.")
    if args.ngpus is not None and args.ngpus > MAX_REPLICAS:  # before it builds a device name per replica
        raise _fail(f"-g must be at most {MAX_REPLICAS}: each device's replica is a thread of this process. "
                    f"Received: {args.ngpus}.")
    if args.minbytes > args.maxbytes:
        raise _fail(f"invalid sizes for 'minbytes' and 'maxbytes': {args.minbytes} > {args.maxbytes}")
    if args.stepfactor == 1 and args.stepbytes < 1:
        raise _fail(f"-f 1 steps the sizes by -i, which must be at least 1 byte. Received: -i {args.stepbytes}.")
    try:
        args.bytes_per_pack = [parse_size(v) for v in str(args.bytes_per_pack).split(",") if v.strip()]
    except ValueError as exc:
        raise _fail(f"--bytes-per-pack takes comma-separated sizes: {exc}") from None


def _check_batch(args: argparse.Namespace, passes: list) -> None:
    """batch_reduce's rows hold whole arrays of --array-bytes: at least one element of every type, and one array."""
    if args.collective != "batch_reduce":
        return
    widest = max(passes, key=lambda p: p.dtype.itemsize)
    if args.array_bytes < widest.dtype.itemsize:
        raise _fail(f"--array-bytes must hold one element of each type measured ({widest.dtype.itemsize} bytes for "
                    f"{widest.type_name}). Received: {args.array_bytes}.")
    if not any(_row_sizes(args, p.dtype) for p in passes):
        raise _fail(f"batch_reduce's rows hold whole arrays: -e must be at least --array-bytes "
                    f"({args.array_bytes}). Received: -e {args.maxbytes}.")


def _output_problem(args: argparse.Namespace) -> str | None:
    """Why --json or --plot cannot be written (None if they can): checked before the measurements, which can take
    minutes, rather than after them."""
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None and not path.strip():  # else silently nothing written
            return f"{flag} needs a file name. Received: {path!r}."
    if args.json and args.plot and pathlib.Path(args.json).absolute() == pathlib.Path(args.plot).absolute():
        return f"--json and --plot must name different files: the plot would replace the results. Received: " \
               f"{args.json!r} for both."
    if args.plot:
        if importlib.util.find_spec("matplotlib") is None:
            return f"--plot needs matplotlib: {pip_install('bench')}."
        formats = report.plot_formats()
        if pathlib.Path(args.plot).suffix.lstrip(".").lower() not in formats:
            return (f"--plot needs a file name ending in a format matplotlib writes ({', '.join(sorted(formats))}). "
                    f"Received: {args.plot!r}.")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if not path:
            continue
        target = pathlib.Path(path).absolute()
        in_the_way = file_in_the_way(str(target))
        if in_the_way is not None:  # else mkdir's "File exists"
            return (f"{flag} must name a file distrib bench can write. Received: {path!r} ({in_the_way!r} is a file, "
                    f"not a folder).")
        try:
            if target.is_dir():
                raise IsADirectoryError(21, "it is a directory")
            if target.exists() and not os.access(target, os.W_OK):
                raise PermissionError(13, "it is read-only")
            target.parent.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=target.parent).close()
        except OSError as exc:
            return f"{flag} must name a file distrib bench can write. Received: {path!r} ({exc.strerror})."
    return None


def _memory_problem(args, collective, passes: list, kind: str, job: Job, devices: list[str]) -> str | None:
    """Why the largest row cannot fit in this process's memory (None if it may)."""
    local = 1 if kind == "cuda" else job.local  # a GPU holds its own rank's buffers; the emulator every local one
    needed = 0
    for this in passes:
        layout = collective.layout(args.maxbytes, this.dtype.itemsize, job.ranks)
        needed = max(needed, memory.needed_bytes(layout.send_count * this.dtype.itemsize,
                                                 layout.recv_count * this.dtype.itemsize, local))
    available = memory.available_bytes(kind, [int(d.split(":")[1]) for d in devices])
    if available is None or needed <= available:
        return None
    where = "on a GPU" if kind == "cuda" else "in this process"
    return (f"-e {args.maxbytes} needs at least {memory.describe(needed)} of memory {where}, more than the "
            f"{memory.describe(available)} free (nccl-tests would lower -e to fit): use a smaller -e. "
            f"Received: -e {args.maxbytes}.")


def _agree(job: Job, problem: str | None) -> str | None:
    """The first rank's problem, on every rank: all stop together, and rank 0 says why."""
    if job.comm is None:
        return problem
    return next((p for p in job.comm.allgather(problem) if p), None)


def build_series(args, strategy, backend_kind: str, job: Job, devices: list[str]) -> list:
    """distrib's series first, then the raw baseline: NumPy on the emulator, cupy.cuda.nccl on GPUs, mpi4py
    across the processes of the emulator under mpirun."""
    import distrib

    if args.collective == "batch_reduce":
        # across processes the strategy's cross-device ops are fixed (CollectiveAllReduce): one reduce_to per array
        per_array = DistribSeries("distrib per array", strategy, one_call_per_array=True) if job.processes > 1 else \
            DistribSeries("distrib per array", distrib.MirroredStrategy(
                devices, cross_device_ops=distrib.NcclAllReduce(num_packs=0)))
        ours = [DistribSeries("distrib packed", strategy), per_array]
        ours += [DistribSeries(f"distrib bytes_per_pack={b}", strategy, distrib.CommunicationOptions(bytes_per_pack=b))
                 for b in args.bytes_per_pack]
        variants = [{}, {"per_array": True}]
    else:
        ours = [DistribSeries("distrib", strategy)]
        variants = [{}, {"in_place": True}]
    if backend_kind == "cuda":
        from distrib.cli.bench.cuda import NcclSeries

        return ours + [NcclSeries([int(d.split(":")[1]) for d in devices], job=job, **v) for v in variants]
    if job.processes > 1:
        from distrib.cli.bench.mpi import MpiSeries

        return ours + [MpiSeries(job.comm, **v) for v in variants]
    return ours + [NumpySeries(**v) for v in variants]


def measure(prepared: Prepared | None, spec: RowSpec, args, job: Job) -> Cell | None:
    """nccl-tests' timing: warm-up calls, then `iters` calls back to back and one wait; then the checked calls.

    Across processes the timed calls start together (a barrier), the time is the processes' mean, and #wrong
    is every process's count summed, each checking its own ranks. As in nccl-tests, the checks stop at the first
    with a wrong element, and #wrong is that check's count (not a sum over the -c checks).
    """
    if prepared is None:
        return None
    for _ in range(args.warmup_iters):
        prepared.step()
    prepared.sync()
    job.barrier()
    start = time.perf_counter()
    for _ in range(args.iters):
        prepared.step()
    prepared.sync()
    us = job.mean((time.perf_counter() - start) / args.iters * 1e6)
    wrong = None
    if args.check:
        expected = spec.expected_here()
        for _ in range(args.check):
            prepared.reset()
            result = prepared.step()
            prepared.sync()
            wrong = job.total(count_wrong(prepared.outputs(result), expected, spec.tolerance))
            if wrong:
                break
    return Cell(us, wrong)


def run(args: argparse.Namespace) -> int:
    """Measures every size for every series, prints the table, writes --json and --plot; 1 if any #wrong.

    Under `mpirun -np N` every device of every process is a rank (MultiWorkerMirroredStrategy); rank 0 alone
    prints and writes files.
    """
    from distrib.backends import detect, get_backend
    from distrib.cli.versions import versions
    from distrib.errors import BackendUnavailableError

    collective = COLLECTIVES[args.collective]
    check_arguments(args)
    try:
        passes, notes = combinations(args.datatype, args.op, args.collective, collective.reduces)
    except SweepError as exc:
        raise _fail(str(exc)) from None
    _check_batch(args, passes)
    if args.root != 0 and not collective.rooted:
        notes.append(f"# -r {args.root} ignored: {args.collective} has no root (as in nccl-tests)")
    try:
        kind = detect()
        backend = get_backend(kind)
        strategy, job, devices = _strategy(args, kind, backend)
    except (BackendUnavailableError, ValueError) as exc:  # DISTRIB_BACKEND or DISTRIB_CPU_REPLICAS it cannot use
        raise _fail(str(exc)) from None
    problem = _agree(job, (_output_problem(args) if job.chief else None)
                     or _memory_problem(args, collective, passes, kind, job, devices))
    if problem:
        raise _fail(problem)
    roots = range(job.ranks) if collective.rooted and args.root == -1 else [args.root]
    series = build_series(args, strategy, kind, job, devices)
    label = job_label(kind, backend, job)
    using = device_lines(kind, backend, devices, job)
    step = f"{args.stepfactor}(factor)" if args.stepfactor > 1 else f"{args.stepbytes}(bytes)"
    lines = [f"# distrib bench {args.collective}: {label}" + (" -- EMULATED, not a GPU measurement"
                                                              if kind == "cpu" else ""),
             f"# nThread 1 nGpus {job.local} minBytes {args.minbytes} maxBytes {args.maxbytes} step: {step} "
             f"warmup iters: {args.warmup_iters} iters: {args.iters} validation: {args.check}",
             *notes, "#", "# Using devices", *using, "#"]
    groups = [s.name for s in series]
    row_count = sum(len(_row_sizes(args, p.dtype)) for p in passes) * len(roots) * len(series)
    out = Output(row_count, plain=mpi_environment() is not None) if job.chief else None
    try:
        if out:
            out.lines(lines + [header(groups, ("vs raw",))])
        rows, busbw, failures = _measure_rows(args, collective, passes, roots, series, job, out)
    finally:  # on Ctrl-C or an error part-way too: the rows measured so far are shown and the cursor restored
        if out:
            out.close()
    for s in series:
        getattr(s, "close", lambda: None)()
    if not job.chief:
        return 1 if failures else 0
    averages = {name: statistics.fmean(values) for name, values in busbw.items() if values}
    out.done([footer(failures, busbw[series[0].name]), *_baseline_averages(groups[1:], busbw), "#",
              concluded(f"distrib bench {args.collective}")])
    type_name = "all" if args.datatype == "all" else passes[0].type_name
    document = {"schema": report.SCHEMA, "collective": args.collective,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "device": label, "backend": kind, "emulated": kind == "cpu", "ranks": job.ranks,
                "processes": job.processes, "type": type_name, "op": args.op, "root": args.root,
                "versions": versions(), "platform": platform.platform(),
                "settings": {k: v for k, v in vars(args).items() if k not in ("func", "json", "plot", "subparser")},
                "series": groups, "rows": rows, "avg_busbw_GBps": averages, "wrong": failures}
    if args.json:
        print(f"# results: {report.write_json(document, args.json)}")
    if args.plot:
        print(f"# plot: {report.plot(document, args.plot)}")
    return 1 if failures else 0


def _measure_rows(args, collective, passes, roots, series, job: Job, out: Output | None) -> tuple:
    """Every row of the sweep, printed as it is measured: (JSON rows, busbw per series, failed measurements).

    A failed measurement is one series' row with a wrong element: what nccl-tests' "Out of bounds values" counts.
    """
    rows, busbw, failures = [], {s.name: [] for s in series}, 0
    for this in passes:
        for root in roots:  # -r -1: nccl-tests' sweep over every root, the sizes for each in turn
            for size in _row_sizes(args, this.dtype):
                layout = collective.layout(size, this.dtype.itemsize, job.ranks)
                spec = RowSpec(collective, layout, this.dtype, this.op, root, job.ranks,
                               args.array_bytes // this.dtype.itemsize, job.first, job.local)
                cells = []
                for s in series:
                    try:
                        cells.append(measure(s.prepare(spec), spec, args, job))
                    except MemoryError:  # the estimate up front was short: this rank's own, so it says so
                        raise _fail(f"{this.type_name} rows of {layout.size} B do not fit in memory "
                                    f"({s.name}): use a smaller -e. Received: -e {args.maxbytes}.",
                                    every_rank=True) from None
                    if out:
                        out.advance(f"{this.type_name} {size} B {s.name}")
                raw = next((c for s, c in zip(series, cells) if not s.name.startswith("distrib") and c), None)
                ratio = f"{cells[0].us / raw.us:.2f}x" if raw and cells[0] and raw.us > 0 else "N/A"
                if out:
                    out.row(row(collective, layout, this.type_name, this.op, root, job.ranks, cells, (ratio,)))
                results = {}
                for s, cell in zip(series, cells):
                    if cell is None:
                        results[s.name] = None
                        continue
                    algbw, bus = bandwidths(collective, layout, cell.us / 1e6, job.ranks)
                    results[s.name] = {"time_us": cell.us, "algbw_GBps": algbw, "busbw_GBps": bus,
                                       "wrong": cell.wrong}
                    busbw[s.name].append(bus)
                    failures += bool(cell.wrong)
                rows.append({"size": layout.size, "count": layout.count, "type": this.type_name,
                             "redop": this.op if collective.reduces else "none",
                             "root": root if collective.rooted else -1, "results": results})
    return rows, busbw, failures


def _baseline_averages(names: list[str], busbw: dict) -> list[str]:
    """Footer lines after nccl-tests' own (distrib's series): each other series' average bus bandwidth, a raw
    series and its in-place variant in one line, as nccl-tests averages its out-of-place and in-place rows."""
    lines = []
    for name in names:
        if name.endswith(" in-place") and name[:-len(" in-place")] in names:
            continue
        values = busbw[name] + busbw.get(f"{name} in-place", [])
        both = f"{name} in-place" in names
        if values:
            lines.append(f"# Avg bus bandwidth ({name}{', out-of-place and in-place' if both else ''}): "
                         f"{statistics.fmean(values):g} ")
    return lines


def _strategy(args, kind: str, backend) -> tuple:
    """(strategy, Job, this process's devices): one process over `-g` devices, or every process of the MPI job."""
    import distrib

    if launched_processes() > 1:
        try:
            strategy, job = multi_worker(args.ngpus, kind)
        except ValueError as exc:
            raise _fail(str(exc)) from None
        devices = list(strategy.extended.worker_devices)
    else:
        count = args.ngpus or len(backend.default_devices())
        if kind == "cuda" and count > len(backend.default_devices()):
            raise _fail(f"-g {count} asks for more GPUs than the {len(backend.default_devices())} visible.")
        devices = [f"{'GPU' if kind == 'cuda' else 'CPU'}:{i}" for i in range(count)]
        strategy, job = distrib.MirroredStrategy(devices), Job(None, 0, count, count)
    if not COLLECTIVES[args.collective].rooted:
        return strategy, job, devices  # -r means nothing here, as in nccl-tests
    if args.root >= job.ranks:
        raise _fail(f"-r must name a rank below the {job.ranks} ranks. Received: {args.root}.")
    if job.processes > 1 and args.collective == "broadcast" and not 0 <= args.root < job.local:
        raise _fail(f"under mpirun, broadcast's root must be one of rank 0's {job.local} devices: "
                    f"MultiWorkerMirroredStrategy broadcasts from the chief"
                    f"{', so -r -1 (every root) cannot run' if args.root == -1 else ''}. Received: -r {args.root}.")
    return strategy, job, devices


def _row_sizes(args, dtype: np.dtype) -> list[int]:
    """The sweep; batch_reduce rows hold whole arrays, so smaller sizes are dropped and others rounded down."""
    all_sizes = sizes(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    if args.collective != "batch_reduce":
        return all_sizes
    unit = max(args.array_bytes // dtype.itemsize, 1) * dtype.itemsize
    return sorted({s // unit * unit for s in all_sizes if s >= unit})
