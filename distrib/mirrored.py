"""MirroredStrategy: one persistent thread per replica, and the rendezvous where merge_call runs cross-replica.

A `run` is a sequence of phases. In each phase every replica thread runs its function until it either returns
or reaches a collective (every collective is a merge_call); once all have reported, the calling thread runs
replica 0's merge function once, in the cross-replica context, hands each replica its share, and starts the
next phase. Replica threads run concurrently, as TensorFlow's replicas do inside a tf.function, so NumPy and
CuPy work in different replicas overlaps; Python state shared between replicas needs a lock.

Failure handling: the first exception in a replica (or in a merge function) stops the run; replicas waiting
at a collective are woken and unwound, and the exception reaches the caller of `run` with the replica id in
its message. A collective that some replicas never reach raises DeadlineExceededError after the timeout. A
replica thread that does not come back is retired and replaced, so the strategy stays usable.
"""

from __future__ import annotations

import _thread
import threading
import time
import weakref
from typing import Any, Callable, Sequence

from distrib import context, timeline
from distrib.backends import Backend, cuda_problem, detect, get_backend
from distrib.backends.parallel import lend
from distrib.cross_device_ops import CrossDeviceOps, default_cross_device_ops
from distrib.devices import canonical_name, parse_device
from distrib.errors import ContextError, DeadlineExceededError, MergeCallMismatchError
from distrib.options import CommunicationOptions, default_timeout
from distrib.extended import StrategyExtended
from distrib.replica_context import ReplicaContext
from distrib.replica_team import ReplicaTeam
from distrib.strategy import Strategy
from distrib.values import regroup, select_replicas

_POLL_SECONDS = 0.05
_STOP_GRACE_SECONDS = 10.0

RUNNING, WAITING, DONE, FAILED = "running", "waiting", "done", "failed"


class _RequestedStop(BaseException):
    """Unwinds a replica function whose run was stopped; a BaseException so `except Exception` cannot eat it."""


class _Run:
    """State of one `Strategy.run`, shared by the calling thread and the replica threads."""

    def __init__(self, strategy: Strategy, contexts: Sequence[ReplicaContext], fn: Callable, args: list,
                 kwargs: list, default_timeout: float):
        count = len(contexts)
        self.strategy, self.contexts, self.fn, self.args, self.kwargs = strategy, contexts, fn, args, kwargs
        self.default_timeout = default_timeout
        self.lock = threading.Lock()
        self.finished = threading.Condition(self.lock)
        self.phase_done = _thread.allocate_lock()
        self.status = [RUNNING] * count
        self.requests: list[Any] = [None] * count
        self.results: list[Any] = [None] * count
        self.merge_results: list[Any] = [None] * count
        self.merge_counts = [0] * count
        self.active = count  # replica threads still inside this run
        self.error: tuple[int | None, BaseException] | None = None
        self.stopped = False
        self.begin_phase()

    def begin_phase(self) -> None:
        self.phase_done.acquire(False)  # locked from here until the phase completes or fails
        self.status = [RUNNING] * len(self.status)
        self.pending = len(self.status)
        self.first_arrival: float | None = None
        self.woken = False

    def _wake(self) -> None:
        if not self.woken:
            self.woken = True
            self.phase_done.release()

    def report(self, replica_id: int, status: str) -> bool:
        """A replica reached a collective (WAITING) or returned (DONE); False if the run was stopped."""
        with self.lock:
            if self.stopped:
                return False
            self.status[replica_id] = status
            if status == WAITING and self.first_arrival is None:
                self.first_arrival = time.monotonic()
            self.pending -= 1
            if self.pending == 0:
                self._wake()
            return True

    def fail(self, replica_id: int | None, exc: BaseException) -> None:
        with self.lock:
            if self.error is None and not self.stopped:
                self.error = (replica_id, exc)
            if replica_id is not None:
                self.status[replica_id] = FAILED
            self._wake()

    def leave(self) -> None:
        with self.finished:
            self.active -= 1
            self.finished.notify_all()


class _ReplicaThread:
    """A daemon thread that runs one replica's function for each run, with its device current."""

    def __init__(self, replica_id: int, device: str, backend: Backend):
        self.replica_id = replica_id
        self.go = _thread.allocate_lock()
        self.go.acquire()
        self.run: _Run | None = None
        self.task: Callable[[], None] | None = None  # a share of the merge's work, handed over by a ReplicaTeam
        self.retired = False
        self.thread = threading.Thread(target=self._main, args=(device, backend), daemon=True,
                                       name=f"distrib-replica-{replica_id}")
        self.thread.start()

    def _main(self, device: str, backend: Backend) -> None:
        backend.activate(device)
        while True:
            self.go.acquire()
            run = self.run
            if run is None or self.retired:
                return
            self._execute(run)
            del run  # a finished run holds results and merge buffers; don't pin them until the next one
            if self.retired:
                return

    def _execute(self, run: _Run) -> None:
        i = self.replica_id
        try:
            with context.frame(run.strategy, run.contexts[i]), timeline.span("run", "run"):
                result = run.fn(*run.args[i], **run.kwargs[i])
            run.results[i] = result
            run.report(i, DONE)
        except _RequestedStop:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of run, which re-raises it
            run.fail(i, exc)
        finally:
            run.leave()

    def rendezvous(self, run: _Run, request: tuple) -> Any:
        """Called on this thread by a collective: wait for the merge, return this replica's result."""
        i = self.replica_id
        run.requests[i] = request
        run.merge_counts[i] += 1
        with timeline.span(request[0], "merge_call"):
            if not run.report(i, WAITING):
                raise _RequestedStop()
            self.go.acquire()
            while self.task is not None:  # lent to the merge: run a share of its work, then wait again
                task, self.task = self.task, None
                task()
                self.go.acquire()
        if run.stopped:
            raise _RequestedStop()
        return run.merge_results[i]

    def shutdown(self) -> None:
        self.run = None
        self.retired = True
        self.go.release()


def _shutdown_threads(threads: list[_ReplicaThread]) -> None:
    for worker in threads:
        if worker.run is None and not worker.retired:
            worker.shutdown()


class MirroredExtended(StrategyExtended):
    """StrategyExtended of MirroredStrategy: replica threads, merge_call rendezvous, timeouts."""

    def __init__(self, container_strategy: Strategy, backend: Backend, devices: Sequence[str],
                 cross_device_ops: CrossDeviceOps, communication_options: CommunicationOptions):
        super().__init__(container_strategy, backend, devices, cross_device_ops, communication_options)
        first = self._first_local_replica
        self._replica_contexts = tuple(ReplicaContext(container_strategy, first + i, first) for i in range(len(devices)))
        self._threads: list[_ReplicaThread] = []
        self._run_lock = threading.Lock()
        self._running_thread: int | None = None
        self._active: list[tuple[_Run, list[_ReplicaThread]]] = []  # the run in progress, and any run nested in it
        self._default_timeout = default_timeout()
        weakref.finalize(container_strategy, _shutdown_threads, self._threads)

    def _ensure_threads(self) -> list[_ReplicaThread]:
        if not self._threads:
            self._threads.extend(_ReplicaThread(i, d, self._backend) for i, d in enumerate(self._devices))
        return self._threads

    def _call_for_each_replica(self, fn, args, kwargs):
        if self._running_thread == threading.get_ident():
            # run from a merge_fn: the replica threads wait in the merge, so this run gets threads of its own
            # (TensorFlow starts threads for every run, so nesting works there too)
            threads = [_ReplicaThread(i, d, self._backend) for i, d in enumerate(self._devices)]
            try:
                return self._run(fn, args, kwargs, threads)
            finally:
                _shutdown_threads(threads)
        with self._run_lock:
            self._running_thread = threading.get_ident()
            try:
                with timeline.span("run", "run"):
                    return self._run(fn, args, kwargs, self._ensure_threads())
            finally:
                self._running_thread = None

    def _run(self, fn, args, kwargs, threads: list[_ReplicaThread]):
        count = len(self._devices)
        run = _Run(self._container_strategy, self._replica_contexts, fn,
                   select_replicas(args, count), select_replicas(kwargs, count), self._default_timeout)
        self._active.append((run, threads))
        try:
            for worker in threads:
                worker.run = run
                worker.go.release()
            while True:
                self._wait_for_phase(run)
                if run.error is not None:
                    raise run.error[1]
                if all(s == DONE for s in run.status):
                    break
                if any(s == DONE for s in run.status):
                    raise MergeCallMismatchError(_count_mismatch(run))
                self._merge(run, threads)
                run.begin_phase()
                for worker in threads:
                    worker.go.release()
        except BaseException as exc:
            self._stop(run, threads, grace=0.1 if isinstance(exc, DeadlineExceededError) else _STOP_GRACE_SECONDS)
            if run.error is not None and exc is run.error[1] and run.error[0] is not None:
                _name_replica(exc, run.error[0], len(threads))
            raise
        finally:
            self._active.pop()
            for worker in threads:
                worker.run = None
        return regroup(run.results)

    def _wait_for_phase(self, run: _Run) -> None:
        while not run.phase_done.acquire(timeout=_POLL_SECONDS):
            with run.lock:
                first = run.first_arrival
                if first is None or run.woken:
                    continue
                arrived = [i for i, s in enumerate(run.status) if s == WAITING]
                kind, _, _, timeout = run.requests[arrived[0]]
                limit = timeout if timeout is not None else run.default_timeout
                if time.monotonic() - first < limit:
                    continue
                missing = tuple(i for i, s in enumerate(run.status) if s == RUNNING)
            raise DeadlineExceededError(
                f"{kind} timed out after {limit:g} s waiting for replicas {list(missing)} (replicas {arrived} "
                f"arrived). Every replica must make the same collective calls in the same order; a replica "
                f"that skips one, or is stuck before it, stalls the others. Raise "
                f"CommunicationOptions(timeout_seconds=...) or $DISTRIB_COLLECTIVE_TIMEOUT if the work is "
                f"just slow.", missing_replicas=missing, operation=kind)

    def _merge(self, run: _Run, threads: list[_ReplicaThread]) -> None:
        kinds = [r[0] for r in run.requests]
        if len(set(kinds)) > 1:
            detail = ", ".join(f"replica {i}: {k}" for i, k in enumerate(kinds))
            raise MergeCallMismatchError(f"Replicas reached different collectives at the same point; every "
                                         f"replica must call them in the same order. Received: {detail}.")
        merge = run.requests[0][1]
        try:
            with context.frame(self._container_strategy, None), lend(ReplicaTeam(threads)), \
                    timeline.span(kinds[0], "merge_call"):
                results = merge([r[2] for r in run.requests])
        except BaseException as exc:
            run.fail(None, exc)
            raise
        run.merge_results = list(results)

    def _stop(self, run: _Run, threads: list[_ReplicaThread], grace: float) -> None:
        """Wakes replicas waiting at a collective so they unwind; retires those that do not come back."""
        with run.lock:
            run.stopped = True
            waiting = [i for i, s in enumerate(run.status) if s == WAITING]
        for i in waiting:
            threads[i].go.release()
        with run.finished:
            run.finished.wait_for(lambda: run.active == 0, timeout=grace)
            stuck = [i for i, s in enumerate(run.status) if s == RUNNING] if run.active else []
        for i in stuck:  # still inside user code: let it finish on its own, and replace it
            threads[i].retired = True
            threads[i] = _ReplicaThread(i, self._devices[i], self._backend)

    def _rendezvous(self, replica_id, kind, merge, payload, options):
        current = threading.current_thread()
        run, worker = next(((run, threads[replica_id]) for run, threads in reversed(self._active)
                            if threads[replica_id].thread is current), (None, None))
        if run is None:
            raise ContextError(f"{kind} must be called from the replica function that Strategy.run is running.")
        if run.stopped:
            raise _RequestedStop()
        return worker.rendezvous(run, (kind, merge, payload, options.timeout))


def _count_mismatch(run: _Run) -> str:
    counts = ", ".join(f"replica {i}: {c}{'+' if s == WAITING else ''}"
                       for i, (c, s) in enumerate(zip(run.merge_counts, run.status)))
    return (f"Replicas made different numbers of merge_call calls (each all_reduce, all_gather and variable "
            f"update is one), so some would wait forever. Calls so far: {counts} ('+' = waiting for more). Make "
            f"every replica call the same collectives, e.g. avoid all_reduce under a replica-dependent `if`.")


def _name_replica(exc: BaseException, replica_id: int, count: int) -> None:
    """Adds the replica id to the exception's message, keeping its type and traceback."""
    if getattr(exc, "replica_id", None) is not None:  # raised again in a later run: already named
        return
    where = f"replica {replica_id} of {count}"
    args = exc.args
    if type(exc).__str__ is BaseException.__str__ and len(args) == 1 and isinstance(args[0], str):
        exc.args = (f"{args[0]} (raised in {where})",)
    elif hasattr(exc, "add_note"):
        exc.add_note(f"distrib: raised in {where}")
    exc.replica_id = replica_id


class MirroredStrategy(Strategy):
    """Synchronous data parallelism: one replica per device, variables mirrored, collectives reduce across them.

    Args:
      devices: device names such as `["GPU:0", "GPU:1"]` or `["CPU:0", "CPU:1", "CPU:2", "CPU:3"]` (emulated);
        None means every GPU when the CUDA backend can run, else `$DISTRIB_CPU_REPLICAS` (default 2) emulated
        CPU devices.
      cross_device_ops: a `NcclAllReduce` (default), `HierarchicalCopyAllReduce` or `ReductionToOneDevice`.
      communication_options: default `CommunicationOptions` for every collective.

    Example:
      >>> import distrib, numpy as np
      >>> strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
      >>> strategy
      <MirroredStrategy devices=('CPU:0', 'CPU:1')>
      >>> out = strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", np.float32(1)))
      >>> strategy.reduce("MEAN", out, axis=None)
      array(2., dtype=float32)
    """

    def __init__(self, devices: Sequence[str] | None = None, cross_device_ops: CrossDeviceOps | None = None,
                 communication_options: CommunicationOptions | None = None):
        backend, devices = _resolve_devices(devices)
        if cross_device_ops is None:
            cross_device_ops = default_cross_device_ops(backend)
        elif not isinstance(cross_device_ops, CrossDeviceOps):
            raise TypeError(f"cross_device_ops must be a CrossDeviceOps such as distrib.NcclAllReduce(). Received: "
                            f"{type(cross_device_ops).__name__}.")
        communication_options = checked_communication_options(communication_options)
        super().__init__(MirroredExtended(self, backend, devices, cross_device_ops, communication_options))


def checked_communication_options(options: CommunicationOptions | None) -> CommunicationOptions:
    """`options`, or the defaults for None; TypeError for anything else."""
    if options is None:
        return CommunicationOptions()
    if not isinstance(options, CommunicationOptions):
        raise TypeError(f"communication_options must be a CommunicationOptions. Received: {type(options).__name__}.")
    return options


def _resolve_devices(devices: Sequence[str] | None) -> tuple[Backend, tuple[str, ...]]:
    if devices is None:
        backend = get_backend(detect())
        return backend, backend.default_devices()
    if isinstance(devices, str) or not isinstance(devices, (list, tuple)):
        raise TypeError(f"devices must be a list of device names such as ['GPU:0', 'GPU:1']. Received: {devices!r}.")
    if not devices:
        raise ValueError("devices must name at least one device. Received: [].")
    names = tuple(canonical_name(d) for d in devices)
    kinds = {parse_device(n).kind for n in names}
    if len(kinds) > 1:
        raise ValueError(f"A MirroredStrategy runs on one kind of device: all GPUs or all (emulated) CPUs. "
                         f"Received: {list(devices)}.")
    if kinds == {"GPU"} and (problem := cuda_problem()) is not None:
        raise ValueError(f"Unknown devices {list(devices)}: GPU devices need the CUDA backend, but {problem}. "
                         f"Without a GPU, name emulated CPU devices such as ['CPU:0', 'CPU:1'].")
    backend = get_backend("cuda" if kinds == {"GPU"} else "cpu")
    for name in names:
        backend.check_device(name)
    if kinds == {"CPU"} and len(set(names)) != len(names):
        raise ValueError(f"No duplicates allowed in `devices` for emulated CPU devices. Received: {list(devices)}.")
    return backend, names
