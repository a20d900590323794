"""The collective timeline: runs, merge_calls, collectives, packs and unpacks as Chrome trace events.

`DISTRIB_TIMELINE=trace.json` records from the first import of distrib until the process exits;
`Strategy.start_timeline(path)` / `stop_timeline()` (or `distrib.timeline.start` / `stop`) record a stretch of
a program. The file is Chrome's trace event format, which Perfetto (ui.perfetto.dev) and chrome://tracing open:
one track per replica (thread or cooperative greenlet), one per device, and one for the thread that calls
`Strategy.run`. Where CuPy's NVTX is available (the CUDA backend registers it) every span is also an NVTX range
of the same name, so Nsight Systems shows the same names beside the GPU's kernels. On CUDA the spans are
host-side: a collective's span ends when it is queued, not when the GPU finishes it.

Under mpirun each rank writes a file of its own, `trace.rank<N>.json`, on the wall clock so that
`distrib timeline merge` lines the ranks up in one trace. This module imports nothing from distrib but mpi_env
(which reads the launcher's environment), so every layer may call it. When no timeline is recording, a hook
costs one module-attribute read and a comparison with None, and an instrumented backend method nothing: it is
wrapped only while a timeline records.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import inspect
import json
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from distrib.file_paths import file_in_the_way, names_a_folder
from distrib.mpi_env import mpi_environment

ENV = "DISTRIB_TIMELINE"

recording: "Timeline | None" = None  # the timeline hooks write to; None when off (read on every hook)
_nvtx: tuple[Callable[[str], Any], Callable[[], Any]] | None = None
_lock = threading.Lock()
_instrumented: list[tuple[type, str, str, Callable]] = []  # (class, method name, category, the method unwrapped)
# while recording: (class, method name) -> (what the class's own dict held before, the timed wrapper put there)
_replaced: dict[tuple[type, str], tuple[Any, Callable]] = {}
_ABSENT = object()  # the class inherited the method


class Timeline:
    """Spans recorded in memory as Chrome trace events, written as JSON by `write()`.

    Args:
      path: where `write()` puts the trace (a `.json` file).

    Example:
      >>> import distrib, numpy as np, tempfile, os, json
      >>> path = os.path.join(tempfile.mkdtemp(), "trace.json")
      >>> strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
      >>> strategy.start_timeline(path)
      >>> two = [np.ones(4, np.float32), np.ones(2, np.float32)]  # packed into one buffer, then unpacked
      >>> _ = strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", two))
      >>> strategy.stop_timeline() == path
      True
      >>> sorted({e["name"] for e in json.load(open(path))["traceEvents"] if e["ph"] == "X"})
      ['all_reduce', 'execute', 'pack', 'run', 'unpack']
    """

    def __init__(self, path: str | os.PathLike):
        self.rank = job_rank()
        self.job = job_id() if self.rank is not None else None
        self.requested = os.fsdecode(path)
        self.path = self.requested if self.rank is None else rank_path(self.requested, self.rank)
        self._events: list[dict] = []  # list.append is atomic: hooks on any thread append without a lock
        self._tracks: dict[str, int] = {}
        if self.rank is None:  # times from the start of the recording
            self._origin, self._pid = time.perf_counter_ns(), os.getpid()
        else:  # wall-clock times, which every rank shares (to NTP's precision across hosts), and the rank as pid
            self._origin, self._pid = time.perf_counter_ns() - time.time_ns(), self.rank

    def __repr__(self) -> str:
        return f"<Timeline path={self.path!r} events={len(self._events)}>"

    def _tid(self, track: str) -> int:
        tid = self._tracks.get(track)
        if tid is None:
            with _lock:
                tid = self._tracks.setdefault(track, len(self._tracks) + 1)
        return tid

    def add(self, name: str, category: str, start_ns: int, end_ns: int, tracks: Iterable[str],
            args: dict | None = None) -> None:
        """One complete event ("ph": "X") per track, from `start_ns` to `end_ns` (time.perf_counter_ns)."""
        ts = (start_ns - self._origin) / 1e3
        dur = (end_ns - start_ns) / 1e3
        for track in tracks:
            event = {"name": name, "cat": category, "ph": "X", "ts": ts, "dur": dur, "pid": self._pid,
                     "tid": self._tid(track)}
            if args:
                event["args"] = args
            self._events.append(event)

    def trace(self) -> dict:
        """The trace as a JSON-ready dict: the events, then the tracks' names and order."""
        name = "distrib" if self.rank is None else f"distrib rank {self.rank}"
        meta = [{"name": "process_name", "ph": "M", "pid": self._pid, "args": {"name": name}},
                {"name": "process_sort_index", "ph": "M", "pid": self._pid, "args": {"sort_index": self.rank or 0}}]
        for track, tid in sorted(self._tracks.items(), key=lambda item: item[1]):
            meta.append({"name": "thread_name", "ph": "M", "pid": self._pid, "tid": tid, "args": {"name": track}})
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": self._pid, "tid": tid,
                         "args": {"sort_index": _sort_key(track)}})
        return {"traceEvents": list(self._events) + meta, "displayTimeUnit": "ms",
                "otherData": _provenance("wall" if self.rank is not None else "start", self.job,
                                         job_size() if self.rank is not None else None,
                                         [] if self.rank is None else [self.rank])}

    def write(self) -> str:
        """Writes the trace to `path` (through a temporary file, so a reader never sees half of it)."""
        return _write_whole(self.path, self.trace())

    def check_writable(self) -> None:
        """Raises now, not after the recording, when `path` cannot be written: a folder where the file would be
        (the path asked for, or this rank's), a file where a folder must be, or a folder a file cannot be put in
        (its missing folders are made)."""
        for path in dict.fromkeys((self.requested, self.path)):
            _check_target(path)
        try:
            temporary = _temporary_beside(self.path)
            temporary.touch(exist_ok=False)
            temporary.unlink()
        except OSError as exc:
            raise _with_message(exc, f"A timeline needs a file it can write. Received: {self.path!r} "
                                     f"({exc.strerror}).") from None


def _check_target(path: str) -> None:
    """Raises when a file cannot be at `path`: a folder is there, or a file holds the name of one of its folders."""
    message = f"A timeline needs a file it can write. Received: {path!r}"
    if names_a_folder(path):
        raise _with_message(IsADirectoryError(errno.EISDIR, ""), f"{message} (a folder; name a file in it, such "
                                                                  f"as trace.json).")
    folder = file_in_the_way(path)
    if folder is not None:
        raise _with_message(NotADirectoryError(errno.ENOTDIR, ""), f"{message} ({folder!r} is a file, not a "
                                                                    f"folder).")


def _temporary_beside(path: str) -> Path:
    """A new temporary file's name next to `path` (hidden, of this process), whose folder is made if missing."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    return target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _write_whole(path: str, trace: dict) -> str:
    """Writes `trace` as JSON to `path` through a temporary file, so a reader never sees half of it; a failure
    leaves no temporary file and names `path`."""
    _check_target(path)  # else os.replace's error names the temporary
    temporary = None
    try:
        temporary = _temporary_beside(path)
        with open(temporary, "x") as file:
            file.write(json.dumps(trace))
        os.replace(temporary, path)
    except OSError as exc:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.remove(temporary)
        raise _with_message(exc, f"A timeline needs a file it can write. Received: {path!r} "
                                 f"({exc.strerror or exc}).") from None
    return path


def job_rank() -> int | None:
    """This process's rank when it is one of several in an MPI job (from the launcher's environment), else None."""
    try:
        environment = mpi_environment()
    except ValueError:  # a malformed launcher variable: MultiWorkerMirroredStrategy reports it
        return None
    return environment[1] if environment is not None and environment[2] > 1 else None


# The launcher's name for the job, which every rank shares (Open MPI, PMIx launchers, Slurm's srun), in order
_JOB_VARIABLES = (("PMIX_NAMESPACE",), ("OMPI_MCA_ess_base_jobid",), ("SLURM_JOB_ID", "SLURM_STEP_ID"))


def job_id() -> str | None:
    """The MPI job's id from the launcher's environment (the same on every rank), None where it gives none."""
    for names in _JOB_VARIABLES:
        if names[0] in os.environ:
            return ".".join(os.environ.get(name, "") for name in names)
    return None


def job_size() -> int | None:
    """The ranks of the MPI job this process is one of (None outside one)."""
    try:
        environment = mpi_environment()
    except ValueError:
        return None
    return None if environment is None else environment[2]


def rank_path(path: str | os.PathLike, rank: int) -> str:
    """Where rank `rank` of a job writes the timeline asked for at `path`: trace.json -> trace.rank0.json."""
    target = Path(path)
    return str(target.with_name(f"{target.stem}.rank{rank}{target.suffix}"))


def merge(paths: Sequence[str | os.PathLike], out: str | os.PathLike) -> str:
    """Writes one trace holding every event of the traces at `paths` (each rank's file of a job); returns `out`.

    Every file must be a trace (a JSON object whose "traceEvents" is a list of events, objects with a "ph"). More
    than one must be the rank traces of one job, each rank once: they are timed on the wall clock, which their
    ranks share. A trace of a single process is timed from the start of its own recording, so it lines up with
    no other; the same file twice, or the same rank from two files, would show its spans twice.

    Raises:
      ValueError: a file is not a trace, or the traces are not the ranks of one job, naming the file(s).
      OSError: a file cannot be read, or `out` cannot be written.
    """
    events: list[dict] = []
    sources: list[tuple[str, dict | None]] = []  # (path, provenance)
    seen: dict[tuple[int, int], str] = {}  # (device, inode) -> the path that named the file first
    for path in map(os.fspath, paths):
        try:
            text = Path(path).read_text()
            identity = os.stat(path)
        except OSError as exc:
            raise _with_message(exc, f"A timeline to merge must be a file that can be read. Received: "
                                     f"{path!r} ({exc.strerror}).") from None
        key = (identity.st_dev, identity.st_ino)
        if key in seen:
            raise ValueError(f"A timeline to merge must be named once: its spans would be in the merged trace twice. "
                             f"Received: {path!r} (the file {seen[key]!r} names).")
        seen[key] = path
        trace = _read_trace(path, text)
        events.extend(trace["traceEvents"])
        sources.append((path, _provenance_of(trace)))
    merged = {"traceEvents": events, "displayTimeUnit": "ms"}
    provenance = _one_job(sources)
    if provenance is not None:
        merged["otherData"] = provenance
    return _write_whole(os.fspath(out), merged)


def _read_trace(path: str, text: str) -> dict:
    """The trace in `text` (read from `path`), or a ValueError naming the file and what is wrong with it."""
    def refuse(what: str) -> ValueError:
        return ValueError(f"A timeline to merge must be a trace distrib wrote (a JSON object whose \"traceEvents\" "
                          f"is a list of events). Received: {path!r} ({what}).")

    try:
        trace = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise refuse(f"not JSON: {exc}") from None
    if not isinstance(trace, dict):
        raise refuse(f"a JSON {_json_kind(trace)}, not an object")
    if "traceEvents" not in trace:
        raise refuse("no \"traceEvents\"")
    trace_events = trace["traceEvents"]
    if not isinstance(trace_events, list):
        raise refuse(f"\"traceEvents\" is a {_json_kind(trace_events)}, not a list")
    for index, event in enumerate(trace_events):
        if not isinstance(event, dict) or not isinstance(event.get("ph"), str):
            raise refuse(f"event {index} is {json.dumps(event)[:60]}, not an object with a \"ph\"")
        for field in ("ts", "dur"):
            if field in event and (isinstance(event[field], bool) or not isinstance(event[field], (int, float))):
                raise refuse(f"event {index}'s {field!r} is {json.dumps(event[field])[:60]}, not a number")
    return trace


def _json_kind(value: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def _provenance(clock: str, job: str | None, size: int | None, ranks: list[int]) -> dict:
    """The trace's otherData: what `merge` checks (its clock, the job, the job's size and the ranks it holds)."""
    return {"producer": "distrib", "clock": clock, "job": job, "job_size": size, "ranks": ranks}


def _provenance_of(trace: dict) -> dict | None:
    """Where a trace comes from: its otherData where distrib wrote it, else (a trace of an older distrib) its
    process names ("distrib rank N" for a rank's, "distrib" for a single process's); None for another program's."""
    other = trace.get("otherData")
    if isinstance(other, dict) and other.get("producer") == "distrib" and isinstance(other.get("ranks"), list):
        return other
    names = [e.get("args", {}).get("name") for e in trace["traceEvents"]
             if e.get("name") == "process_name" and isinstance(e.get("args"), dict)]
    ranks = [int(name.rpartition(" ")[2]) for name in names
             if isinstance(name, str) and name.startswith("distrib rank ") and name.rpartition(" ")[2].isdigit()]
    if ranks and len(ranks) == len(names):
        return _provenance("wall", None, None, ranks)
    if names == ["distrib"]:
        return _provenance("start", None, None, [])
    return None


def _one_job(sources: list[tuple[str, dict | None]]) -> dict | None:
    """The merged trace's otherData (None where unknown); a ValueError where the traces cannot be lined up in time:
    a single process's among others, another program's, two jobs', or one rank twice."""
    if len(sources) == 1:
        return sources[0][1]
    holder: dict[int, str] = {}
    for path, provenance in sources:
        if provenance is None:
            raise ValueError(f"Timelines to merge must be the rank traces distrib wrote under mpirun: they are lined "
                             f"up in time by the clock their ranks share. Received: {path!r} (not a trace of a rank "
                             f"of an MPI job: no \"distrib rank N\" process).")
        if provenance.get("clock") != "wall":
            raise ValueError(f"Timelines to merge must be the rank traces of one MPI job (trace.rank<N>.json, from "
                             f"DISTRIB_TIMELINE or start_timeline under mpirun). Received: {path!r} (a single "
                             f"process's trace, timed from the start of its own recording: it lines up with no "
                             f"other).")
        for rank in provenance["ranks"]:
            if rank in holder:
                raise ValueError(f"Timelines to merge must hold each rank once: its spans would be in the merged "
                                 f"trace twice. Received: rank {rank} in both {holder[rank]!r} and {path!r}.")
            holder[rank] = path
    for field, what in (("job", "job"), ("job_size", "number of ranks")):
        known = {provenance[field]: path for path, provenance in sources if provenance.get(field) is not None}
        if len(known) > 1:
            (a, first), (b, second) = list(known.items())[:2]
            raise ValueError(f"Timelines to merge must be the rank traces of one MPI job. Received: {first!r} and "
                             f"{second!r}, of different jobs ({what} {a} and {b}).")
    first = sources[0][1]
    return _provenance("wall", first.get("job"), first.get("job_size"), sorted(holder))


def _with_message(exc: OSError, message: str) -> OSError:
    """`exc`'s type and errno with `message` as the whole text (no "[Errno N]" before the rule)."""
    error = type(exc)(message)
    error.errno = exc.errno
    return error


def _sort_key(track: str) -> int:
    """The caller's track first, then the replicas, then the devices, each in numeric order."""
    if track.startswith("replica "):
        return 100 + int(track.split()[-1])
    index = track.partition(":")[2]
    return 1000 + int(index) if index.isdigit() else 0


def start(path: str | os.PathLike) -> Timeline:
    """Starts recording every span of this process into a new timeline written to `path` by `stop()`.

    Raises:
      RuntimeError: a timeline is already recording.
      OSError: `path` cannot be written: it is a folder (IsADirectoryError), a file holds the name of one of
        its folders (NotADirectoryError), its folder cannot be made or a file cannot be put there.
    """
    global recording
    with _lock:
        if recording is not None:
            raise RuntimeError(f"A timeline is already recording to {recording.path!r}; stop it first.")
        timeline = Timeline(path)
        timeline.check_writable()
        recording = timeline
        _wrap_instrumented(True)
        return recording


def stop() -> str | None:
    """Stops recording and writes the trace; returns its path (None if nothing was recording).

    Raises:
      OSError: the trace cannot be written (say a folder took its name meanwhile), naming the path; the
        recording is lost and no temporary file is left.
    """
    global recording
    with _lock:
        timeline, recording = recording, None
        _wrap_instrumented(False)
    return timeline.write() if timeline is not None else None


def instrument(cls: type, methods: dict[str, str]) -> None:
    """Records every call of `cls`'s `methods` (name -> event category) on the timelines, through `timed`.

    They are wrapped only while a timeline records, so that a call costs nothing more otherwise (a backend's
    collectives run right after a transfer has left the caches cold, where a wrapper's call costs 1-2 µs). A
    method `cls` inherits from a class instrumented already is left to that class.
    """
    with _lock:
        for name, category in methods.items():
            function = getattr(cls, name, None)
            if function is None or getattr(function, "__isabstractmethod__", False) or hasattr(function, "timed_as") \
                    or any(known is function for _, _, _, known in _instrumented):
                continue
            _instrumented.append((cls, name, category, function))
            if recording is not None:
                _wrap(cls, name, category, getattr(cls, name))


def _wrap_instrumented(on: bool) -> None:
    """Wraps the instrumented methods as the classes hold them now (so wrappers added since, such as the CUDA
    backend's error translation, stay inside the timing), or puts back what each class held before."""
    if on:
        current = [(cls, name, category, getattr(cls, name)) for cls, name, category, _ in _instrumented]
        for cls, name, category, method in current:  # read first: a subclass must not time its parent's wrapper
            _wrap(cls, name, category, method)
        return
    for (cls, name), (before, wrapper) in list(_replaced.items()):
        if cls.__dict__.get(name) is wrapper:  # else something wrapped it since: leave that in place
            if before is _ABSENT:
                delattr(cls, name)
            else:
                setattr(cls, name, before)
    _replaced.clear()


def _wrap(cls: type, name: str, category: str, method: Callable) -> None:
    wrapper = timed(method, name, category)
    before = _replaced[cls, name][0] if (cls, name) in _replaced else cls.__dict__.get(name, _ABSENT)
    _replaced[cls, name] = (before, wrapper)
    setattr(cls, name, wrapper)


def use_nvtx(push: Callable[[str], Any], pop: Callable[[], Any]) -> None:
    """Makes every span also an NVTX range (the CUDA backend passes CuPy's RangePush and RangePop)."""
    global _nvtx
    _nvtx = (push, pop)


_track = threading.local()  # .name: the track of the cooperative replica running on this thread, if any


def set_track(name: str | None) -> None:
    """Makes `name` the calling thread's track (None: the thread's own): a cooperative replica, a greenlet on the
    caller's thread, records on its replica's track (`track_override` gives the one to put back)."""
    _track.name = name


def track_override() -> str | None:
    """The track that `set_track` made the calling thread's, None if none."""
    return getattr(_track, "name", None)


def thread_track() -> str:
    """The calling thread's track: 'replica k' on a replica thread or cooperative replica, else the thread's name."""
    override = track_override()
    if override is not None:
        return override
    name = threading.current_thread().name
    return name.replace("distrib-replica-", "replica ") if name.startswith("distrib-replica-") else name


class span:
    """Records the block as one event on `tracks` (default: the calling thread's) while a timeline records.

    Args:
      name: the event's name ("run", "all_reduce", ...).
      category: the event's category ("run", "merge_call", "collective", "pack").
      tracks: track names such as ("replica 0",) or ("GPU:0", "GPU:1").
      args: the event's args, such as {"bytes": 4096}.

    Example:
      >>> from distrib import timeline
      >>> with timeline.span("load", "input"):
      ...     pass
    """

    __slots__ = ("name", "category", "tracks", "args", "start")

    def __new__(cls, name: str, category: str, tracks: tuple[str, ...] | None = None, args: dict | None = None):
        # while nothing records, one shared do-nothing block: replica threads pass through several spans per step
        return _OFF if recording is None else object.__new__(cls)

    def __init__(self, name: str, category: str, tracks: tuple[str, ...] | None = None, args: dict | None = None):
        self.name, self.category, self.tracks, self.args = name, category, tracks, args

    def __enter__(self) -> "span":
        if recording is not None:
            if _nvtx is not None:
                _nvtx[0](self.name)
            self.start = time.perf_counter_ns()
        return self

    def __exit__(self, *exc) -> None:
        timeline = recording
        if timeline is not None and hasattr(self, "start"):
            end = time.perf_counter_ns()
            if _nvtx is not None:
                _nvtx[1]()
            timeline.add(self.name, self.category, self.start, end, self.tracks or (thread_track(),), self.args)

    def __repr__(self) -> str:
        return f"<span {self.name!r} category={self.category!r}>"


class _Off:
    """What `span(...)` is while no timeline records: a block that records nothing."""

    __slots__ = ()

    def __enter__(self) -> "_Off":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def __repr__(self) -> str:
        return "<span (no timeline recording)>"


_OFF = _Off()


def timed(method: Callable, name: str, category: str) -> Callable:
    """`method` (a backend method) recorded as an event on the devices it names, when a timeline records.

    The devices come from its `devices` or `device` argument; without one, the event goes on the calling
    thread's track. The event's args give its bytes: of its first array argument or of its result, the larger.
    """
    parameters = list(inspect.signature(method).parameters)
    where = next((p for p in ("devices", "device") if p in parameters), None)
    position = parameters.index(where) - 1 if where else None  # minus self

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        timeline = recording
        if timeline is None:
            return method(self, *args, **kwargs)
        if _nvtx is not None:
            _nvtx[0](name)
        start_ns = time.perf_counter_ns()
        result = None
        try:
            result = method(self, *args, **kwargs)
            return result
        finally:
            end_ns = time.perf_counter_ns()
            if _nvtx is not None:
                _nvtx[1]()
            devices = kwargs.get(where) if where in kwargs else args[position] if where and position < len(args) \
                else None
            tracks = (devices,) if isinstance(devices, str) else tuple(devices) if devices else (thread_track(),)
            timeline.add(name, category, start_ns, end_ns, tracks,
                         {"bytes": max(_nbytes(args[0] if args else None), _nbytes(result))})

    wrapper.timed_as = name
    return wrapper


def _nbytes(value: Any) -> int:
    """Bytes of an array, or of the first array of a list of them (0 for anything else)."""
    if isinstance(value, (list, tuple)):
        value = value[0] if value and not isinstance(value[0], (list, tuple)) else None
    return int(getattr(value, "nbytes", 0))


environment_error: OSError | None = None  # why DISTRIB_TIMELINE cannot be recorded, raised by check_environment()


def check_environment() -> None:
    """Raises the error of a DISTRIB_TIMELINE that cannot be written (a folder, a path under a file, a folder where
    a file cannot be put), naming it: the first backend a program makes calls it, before any collective, rather than
    `import distrib` (which the `distrib` command needs, to refuse it in one line) or the end of the program (which
    would lose the whole recording)."""
    if environment_error is not None:
        raise _with_message(environment_error, str(environment_error))


def _start_from_environment() -> None:
    global environment_error
    path = os.environ.get(ENV, "").strip()
    if path and recording is None:
        try:
            start(path)
        except OSError as exc:
            environment_error = _with_message(exc, f"{ENV}: {exc}")
            return
        atexit.register(stop)


_start_from_environment()
