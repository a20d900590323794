"""`distrib bench <collective>`: nccl-tests' flags and table for distrib's collectives, beside the raw baseline."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import statistics
import sys
import time

import numpy as np

from distrib.cli.bench import report
from distrib.cli.bench.runners import DistribSeries, NumpySeries, Prepared, RowSpec, count_wrong
from distrib.cli.bench.table import COLLECTIVES, Cell, footer, header, parse_size, row, sizes

# nccl-tests' type names (and NumPy's), as -d takes them
TYPES = {"int8": "int8", "uint8": "uint8", "int32": "int32", "uint32": "uint32", "int64": "int64",
         "uint64": "uint64", "half": "float16", "float": "float32", "double": "float64", "bfloat16": "bfloat16",
         "float16": "float16", "float32": "float32", "float64": "float64"}
NCCL_TYPE_NAMES = {"float16": "half", "float32": "float", "float64": "double"}
BATCH_DEFAULTS = ("4K", "1M")  # -b and -e for batch_reduce: 4 to 1,024 arrays of 1 KiB


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """nccl-tests' flags, with its meanings, and distrib's own (--json, --plot, the batch settings)."""
    parser.add_argument("collective", choices=tuple(COLLECTIVES), help="the collective to measure")
    parser.add_argument("-b", "--minbytes", type=parse_size, default=None,
                        help="smallest size in bytes, K/M/G allowed (default 8; batch_reduce 4K)")
    parser.add_argument("-e", "--maxbytes", type=parse_size, default=None,
                        help="largest size in bytes (default 32M; batch_reduce 1M)")
    parser.add_argument("-i", "--stepbytes", type=parse_size, default=1 << 20,
                        help="increment between sizes when -f is 1 (default 1M)")
    parser.add_argument("-f", "--stepfactor", type=int, default=2,
                        help="multiplication factor between sizes; 1 steps by -i instead (default 2)")
    parser.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size (default 20)")
    parser.add_argument("-w", "--warmup_iters", type=int, default=5, help="untimed iterations first (default 5)")
    parser.add_argument("-c", "--check", type=int, default=1,
                        help="checked iterations per size, each against the host's answer; 0 prints N/A (default 1)")
    parser.add_argument("-d", "--datatype", default="float", choices=tuple(TYPES), help="element type (default float)")
    parser.add_argument("-o", "--op", default="sum", help="sum or avg (distrib's ReduceOp SUM and MEAN; default sum)")
    parser.add_argument("-g", "--ngpus", type=int, default=None,
                        help="devices, one rank each (default: every GPU, or $DISTRIB_CPU_REPLICAS emulated devices)")
    parser.add_argument("-r", "--root", type=int, default=0, help="root rank of broadcast and reduce (default 0)")
    parser.add_argument("--array-bytes", type=parse_size, default=1024,
                        help="batch_reduce: bytes per array (default 1K)")
    parser.add_argument("--bytes-per-pack", default="64K",
                        help="batch_reduce: comma-separated CommunicationOptions.bytes_per_pack values to sweep "
                             "beside packed and per array (default 64K; '' for none)")
    parser.add_argument("--json", metavar="FILE", default=None, help="write the results as JSON")
    parser.add_argument("--plot", metavar="FILE.png", default=None, help="plot bus bandwidth against size")


def _fail(parser_name: str, message: str) -> SystemExit:
    print(f"distrib bench: error: {message}", file=sys.stderr)
    return SystemExit(2)


def check_arguments(args: argparse.Namespace) -> None:
    """Rejects what distrib cannot measure, saying why (exit status 2, as argparse does)."""
    default_b, default_e = BATCH_DEFAULTS if args.collective == "batch_reduce" else ("8", "32M")
    args.minbytes = parse_size(default_b) if args.minbytes is None else args.minbytes
    args.maxbytes = parse_size(default_e) if args.maxbytes is None else args.maxbytes
    if args.op in ("prod", "min", "max", "mulsum"):
        raise _fail("bench", f"-o {args.op} is an nccl-tests op that distrib does not have: distrib reduces with "
                             f"SUM and MEAN only, as tf.distribute's ReduceOp. Use -o sum or -o avg.")
    if args.op not in ("sum", "avg"):
        raise _fail("bench", f"-o takes sum or avg. Received: {args.op!r}.")
    dtype = TYPES[args.datatype]
    if args.op == "avg" and not (dtype.startswith("float") or dtype == "bfloat16"):
        raise _fail("bench", f"-o avg needs a floating type (distrib's integer MEAN returns floats, as "
                             f"TensorFlow's). Received: -d {args.datatype}.")
    if args.op == "avg" and args.collective == "reduce_scatter":
        raise _fail("bench", "reduce_scatter sums only (-o sum): distrib's reduce-scatter is the first half of a "
                             "ring all-reduce, which divides after the gather.")
    for flag, value, low in (("-n", args.iters, 1), ("-w", args.warmup_iters, 0), ("-c", args.check, 0),
                             ("-f", args.stepfactor, 1), ("-r", args.root, 0), ("--array-bytes", args.array_bytes, 1)):
        if value < low:
            raise _fail("bench", f"{flag} must be at least {low}. Received: {value}.")
    if args.minbytes > args.maxbytes:
        raise _fail("bench", f"invalid sizes for 'minbytes' and 'maxbytes': {args.minbytes} > {args.maxbytes}")
    args.bytes_per_pack = [parse_size(v) for v in str(args.bytes_per_pack).split(",") if v.strip()]


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ModuleNotFoundError:
            raise _fail("bench", "-d bfloat16 needs ml_dtypes: pip install 'distrib[bench]'.") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def build_series(args, strategy, backend_kind: str, ranks: int) -> list:
    """distrib's series first, then the raw baseline: NumPy on the emulator, cupy.cuda.nccl on GPUs."""
    import distrib

    if args.collective == "batch_reduce":
        devices = list(strategy.extended.worker_devices)
        ours = [DistribSeries("distrib packed", strategy),
                DistribSeries("distrib per array", distrib.MirroredStrategy(
                    devices, cross_device_ops=distrib.NcclAllReduce(num_packs=0)))]
        ours += [DistribSeries(f"distrib bytes_per_pack={b}", strategy, distrib.CommunicationOptions(bytes_per_pack=b))
                 for b in args.bytes_per_pack]
        variants = [{}, {"per_array": True}]
    else:
        ours = [DistribSeries("distrib", strategy)]
        variants = [{}, {"in_place": True}]
    if backend_kind == "cuda":
        from distrib.cli.bench.cuda import NcclSeries

        return ours + [NcclSeries(list(range(ranks)), **v) for v in variants]
    return ours + [NumpySeries(**v) for v in variants]


def measure(prepared: Prepared | None, spec: RowSpec, args) -> Cell | None:
    """nccl-tests' timing: warm-up calls, then `iters` calls back to back and one wait; then the checked calls."""
    if prepared is None:
        return None
    for _ in range(args.warmup_iters):
        prepared.step()
    prepared.sync()
    start = time.perf_counter()
    for _ in range(args.iters):
        prepared.step()
    prepared.sync()
    us = (time.perf_counter() - start) / args.iters * 1e6
    wrong = None
    if args.check:
        expected = spec.expected()
        wrong = 0
        for _ in range(args.check):
            prepared.reset()
            result = prepared.step()
            prepared.sync()
            wrong += count_wrong(prepared.outputs(result), expected)
    return Cell(us, wrong)


def _describe(backend_kind: str, backend, devices: list[str]) -> tuple[str, list[str]]:
    """The device label for titles and file names, and nccl-tests' "Using devices" lines."""
    pid, host = os.getpid(), socket.gethostname()
    if backend_kind == "cpu":
        label = f"CPU emulator, {len(devices)} emulated devices on {os.cpu_count()} cores (NumPy)"
        lines = [f"#  Rank {r:2d} Pid {pid:6d} on {host:>10s} device {d} (emulated on NumPy)"
                 for r, d in enumerate(devices)]
        return label, lines
    gpus = backend.gpus
    label = f"{len(devices)} x {gpus[0].name}"
    lines = [f"#  Rank {r:2d} Pid {pid:6d} on {host:>10s} device {r:2d} [{gpus[r].pci_bus_id}] {gpus[r].name}"
             for r in range(len(devices))]
    return label, lines


def run(args: argparse.Namespace) -> int:
    """Measures every size for every series, prints the table, writes --json and --plot; 1 if any #wrong."""
    import distrib
    from distrib.backends import detect, get_backend
    from distrib.cli.versions import versions

    check_arguments(args)
    dtype = _np_dtype(TYPES[args.datatype])
    kind = detect()
    backend = get_backend(kind)
    count = args.ngpus or len(backend.default_devices())
    prefix = "GPU" if kind == "cuda" else "CPU"
    if kind == "cuda" and count > len(backend.default_devices()):
        raise _fail("bench", f"-g {count} asks for more GPUs than the {len(backend.default_devices())} visible.")
    if args.root >= count:
        raise _fail("bench", f"-r must name a rank below -g {count}. Received: {args.root}.")
    devices = [f"{prefix}:{i}" for i in range(count)]
    strategy = distrib.MirroredStrategy(devices)
    collective = COLLECTIVES[args.collective]
    series = build_series(args, strategy, kind, count)
    label, device_lines = _describe(kind, backend, devices)
    type_name = NCCL_TYPE_NAMES.get(dtype.name, dtype.name)
    step = f"{args.stepfactor}(factor)" if args.stepfactor > 1 else f"{args.stepbytes}(bytes)"
    lines = [f"# distrib bench {args.collective}: {label}" + (" -- EMULATED, not a GPU measurement"
                                                              if kind == "cpu" else ""),
             f"# nThread 1 nGpus {count} minBytes {args.minbytes} maxBytes {args.maxbytes} step: {step} "
             f"warmup iters: {args.warmup_iters} iters: {args.iters} validation: {args.check}",
             "#", "# Using devices", *device_lines, "#"]
    extra = ("vs raw",)
    groups = [s.name for s in series]
    out = _Output(len(_row_sizes(args, dtype)) * len(series))
    out.lines(lines + [header(groups, extra)])
    rows, busbw, wrong_total = [], {s.name: [] for s in series}, 0
    for size in _row_sizes(args, dtype):
        layout = collective.layout(size, dtype.itemsize, count)
        spec = RowSpec(collective, layout, dtype, args.op, args.root, count, args.array_bytes // dtype.itemsize)
        cells = []
        for s in series:
            cells.append(measure(s.prepare(spec), spec, args))
            out.advance(f"{size} B {s.name}")
        raw = next((c for s, c in zip(series, cells) if not s.name.startswith("distrib") and c), None)
        ratio = f"{cells[0].us / raw.us:.2f}x" if raw and cells[0] and raw.us > 0 else "N/A"
        out.row(row(collective, layout, type_name, args.op, args.root, count, cells, (ratio,)))
        results = {}
        for s, cell in zip(series, cells):
            if cell is None:
                results[s.name] = None
                continue
            from distrib.cli.bench.table import bandwidths

            algbw, bus = bandwidths(collective, layout, cell.us / 1e6, count)
            results[s.name] = {"time_us": cell.us, "algbw_GBps": algbw, "busbw_GBps": bus, "wrong": cell.wrong}
            busbw[s.name].append(bus)
            wrong_total += cell.wrong or 0
        rows.append({"size": layout.size, "count": layout.count, "type": type_name,
                     "redop": args.op if collective.reduces else "none", "root": args.root if collective.rooted else -1,
                     "results": results})
    averages = {name: statistics.fmean(values) for name, values in busbw.items() if values}
    out.done([footer(wrong_total, busbw[series[0].name], series[0].name)]
             + [f"# {'Avg bus bandwidth (' + name + ')':<21s}: {averages[name]:g} " for name in groups[1:]
                if name in averages] + ["#"])
    document = {"schema": report.SCHEMA, "collective": args.collective,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "device": label, "backend": kind, "emulated": kind == "cpu", "ranks": count, "type": type_name,
                "op": args.op, "root": args.root, "versions": versions(), "platform": platform.platform(),
                "settings": {k: v for k, v in vars(args).items() if k not in ("func", "json", "plot")},
                "series": groups, "rows": rows, "avg_busbw_GBps": averages, "wrong": wrong_total}
    if args.json:
        print(f"# results: {report.write_json(document, args.json)}")
    if args.plot:
        print(f"# plot: {report.plot(document, args.plot)}")
    for s in series:
        getattr(s, "close", lambda: None)()
    return 1 if wrong_total else 0


def _row_sizes(args, dtype: np.dtype) -> list[int]:
    """The sweep; batch_reduce rows hold whole arrays, so smaller sizes are dropped and others rounded down."""
    all_sizes = sizes(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    if args.collective != "batch_reduce":
        return all_sizes
    unit = max(args.array_bytes // dtype.itemsize, 1) * dtype.itemsize
    return sorted({s // unit * unit for s in all_sizes if s >= unit})


class _Output:
    """Plain nccl-tests text, row by row, when piped; a progress bar and then a rich table on a terminal."""

    def __init__(self, steps: int):
        self.rich = sys.stdout.isatty() and _has_rich()
        self._rows: list[str] = []
        self._head: list[str] = []
        if self.rich:
            from rich.progress import Progress

            self._progress = Progress(transient=True)
            self._task = self._progress.add_task("measuring", total=steps)
            self._progress.start()

    def lines(self, lines: list[str]) -> None:
        if self.rich:
            self._head = lines
        else:
            print("\n".join(lines), flush=True)

    def advance(self, what: str) -> None:
        if self.rich:
            self._progress.update(self._task, advance=1, description=what)

    def row(self, text: str) -> None:
        if self.rich:
            self._rows.append(text)
        else:
            print(text, flush=True)

    def done(self, lines: list[str]) -> None:
        if not self.rich:
            print("\n".join(lines), flush=True)
            return
        from rich.console import Console
        from rich.table import Table

        self._progress.stop()
        console = Console()
        titles, names = self._head[-3], self._head[-2].lstrip("#").split()
        for line in self._head[:-3]:
            console.print(line, highlight=False, markup=False)
        table = Table(title=" | ".join(t for t in titles.split("  ") if t.strip()), title_justify="left")
        for name in names:
            table.add_column(name, justify="right")
        for text in self._rows:
            table.add_row(*text.split())
        console.print(table)
        for line in lines:
            console.print(line, highlight=False, markup=False)


def _has_rich() -> bool:
    try:
        import rich  # noqa: F401
    except ModuleNotFoundError:
        return False
    return True
