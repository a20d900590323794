"""The replica threads of a MirroredStrategy, the state of one run that they share with its caller, and how a
replica's failure is told (its id in the error, the collective counts that do not match)."""

from __future__ import annotations

import _thread
import faulthandler
import queue
import tempfile
import threading
import time
import weakref
from typing import Any, Callable, Sequence

from distrib import context, timeline
from distrib.backends import Backend
from distrib.interrupts import deferred_interrupts

RUNNING, WAITING, DONE, FAILED = "running", "waiting", "done", "failed"

_STACK_FRAMES = 6  # innermost frames shown for a replica that is late
_executing = threading.local()  # .worker: the ReplicaThread running on this thread


class RequestedStop(BaseException):
    """Unwinds a replica function whose run was stopped; a BaseException so `except Exception` cannot eat it."""


class Run:
    """State of one `Strategy.run`, shared by the calling thread and the replica threads.

    Args:
      strategy: the strategy running.
      contexts: one ReplicaContext per replica.
      fn, args, kwargs: what each replica calls, with args and kwargs already selected per replica.
      default_timeout: seconds a collective waits when its options give none.
      deadline: `time.monotonic()` by which the whole run must end, or None.
    """

    def __init__(self, strategy: Any, contexts: Sequence[Any], fn: Callable, args: list, kwargs: list,
                 default_timeout: float, deadline: float | None):
        count = len(contexts)
        self.strategy, self.contexts, self.fn, self.args, self.kwargs = strategy, contexts, fn, args, kwargs
        self.default_timeout, self.deadline = default_timeout, deadline
        self.lock = _thread.allocate_lock()
        self.phase_done = _thread.allocate_lock()
        self.all_left = _thread.allocate_lock()  # released by the last replica thread to leave the run
        self.all_left.acquire()
        self.present = count  # replica threads not yet finished with this run
        self.status = [RUNNING] * count
        self.requests: list[Any] = [None] * count
        self.results: list[Any] = [None] * count
        self.merge_results: list[Any] = [None] * count
        self.merge_counts = [0] * count
        self.left = [False] * count  # replicas whose thread has finished with this run
        self.error: tuple[int | None, BaseException] | None = None
        self.stopped = False
        self.begin_phase()

    def __repr__(self) -> str:
        return f"<Run status={self.status} stopped={self.stopped}>"

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

    def finish(self, replica_id: int, result: Any) -> None:
        """A replica returned `result` and its thread is finished with the run: `report(DONE)` and `leave`."""
        with self.lock:
            if not self.stopped:
                self.results[replica_id] = result
                self.status[replica_id] = DONE
                self.pending -= 1
                if self.pending == 0:
                    self._wake()
            self._leave(replica_id)

    def leave(self, replica_id: int) -> None:
        """The replica's thread is finished with the run (returned, failed or stopped)."""
        with self.lock:
            self._leave(replica_id)

    def _leave(self, replica_id: int) -> None:
        if not self.left[replica_id]:
            self.left[replica_id] = True
            self.present -= 1
            if self.present == 0:
                self.all_left.release()

    def wait_until_all_left(self, timeout: float) -> bool:
        """Whether every replica thread left the run within `timeout` seconds."""
        if self.all_left.acquire(timeout=max(timeout, 0)):
            self.all_left.release()  # stays open for any later wait
            return True
        return False

    def drop_references(self) -> None:
        """Forgets the error, the inputs and the results, so that a kept traceback does not keep them alive."""
        count = len(self.status)
        self.error = None
        self.fn, self.args, self.kwargs = None, [()] * count, [{}] * count
        self.requests, self.results, self.merge_results = [None] * count, [None] * count, [None] * count


class ReplicaThread:
    """A daemon thread that runs one replica's function for each run, with its device current.

    Args:
      replica_id: the replica it runs.
      device: the device made current on the thread.
      backend: the backend that owns the device.
    """

    def __init__(self, replica_id: int, device: str, backend: Backend):
        self.replica_id = replica_id
        self.go = _thread.allocate_lock()  # released to start a run, and to resume after each merge
        self.go.acquire()
        self.run: Run | None = None  # the run to start when `go` is released
        self.current: Run | None = None  # the run this thread is inside
        self.task: Callable[[], None] | None = None  # a share of the merge's work, handed over by a ReplicaTeam
        self.wake_next: ReplicaThread | None = None  # woken by this thread as soon as it wakes (see `wake_all`)
        self.retired = False
        _start_reaper()
        self.thread = threading.Thread(target=self._main, args=(device, backend), daemon=True,
                                       name=f"distrib-replica-{replica_id}")
        self.thread.start()

    def __repr__(self) -> str:
        return f"<ReplicaThread replica={self.replica_id} retired={self.retired} alive={self.thread.is_alive()}>"

    def _main(self, device: str, backend: Backend) -> None:
        _executing.worker = self
        backend.activate(device)
        while True:
            self._wait_for_wake()
            run = self.run
            if run is None or self.retired:
                return
            self.current = run
            self._execute(run)
            self.current = None
            del run  # a finished run holds results and merge buffers; don't pin them until the next one
            if self.retired:
                return

    def _execute(self, run: Run) -> None:
        i = self.replica_id
        try:
            with context.frame(run.strategy, run.contexts[i]), timeline.span("run", "run"):
                result = run.fn(*run.args[i], **run.kwargs[i])
        except RequestedStop:
            run.leave(i)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of run, which re-raises it
            try:
                run.fail(i, exc)
            finally:
                run.leave(i)
        else:
            run.finish(i, result)

    def rendezvous(self, run: Run, request: tuple) -> Any:
        """Called on this thread by a collective: wait for the merge, return this replica's result."""
        i = self.replica_id
        run.requests[i] = request
        run.merge_counts[i] += 1
        with timeline.span(request[0], "merge_call"):
            if not run.report(i, WAITING):
                raise RequestedStop()
            self._wait_for_wake()
        if run.stopped:
            raise RequestedStop()
        return run.merge_results[i]

    def _wait_for_wake(self) -> None:
        """Waits until woken to start or resume a run; runs each task handed over meanwhile (a share of a merge's
        work, or of a reduction's outside any run) and waits again."""
        while True:
            self.go.acquire()
            self._pass_on()
            task, self.task = self.task, None
            if task is None:
                return
            task()

    def _pass_on(self) -> None:
        following, self.wake_next = self.wake_next, None
        if following is not None:
            following.wake()

    def wake(self) -> None:
        """Releases `go`: starts a run, resumes after a merge, or hands over a task."""
        try:
            self.go.release()
        except RuntimeError:  # already released (by `retire`, or a stopped run) and not yet taken: it wakes anyway
            pass

    def retire(self) -> None:
        """Ends the thread once it is back from whatever it is doing; it takes no further run."""
        self.run = None
        self.retired = True
        self.wake_next = None  # a retired thread starts no phase of a later run
        self.wake()  # if it waits for a run; else it sees `retired` once back

    def stack(self) -> str:
        """Where the thread is now: its innermost Python frames, or a note that it has ended.

        Read with faulthandler, which takes no lock: `sys._current_frames()` waits for the interpreter's thread
        list lock, which a process that forked, or runs native threads, may never give back.
        """
        if not self.thread.is_alive():
            return "    (the thread has ended)\n"
        with tempfile.TemporaryFile("w+") as dump:
            faulthandler.dump_traceback(dump, all_threads=True)
            dump.seek(0)
            text = dump.read()
        header = f"Thread 0x{self.thread.ident:016x}"
        for block in text.split("\n\n"):
            if block.lstrip().startswith(header) or f"\n{header}" in block:
                lines = [line for line in block.splitlines()[1:] if line.strip()]
                return "".join(f"  {line.strip()}\n" for line in lines[:_STACK_FRAMES])
        return "    (no stack available)\n"


def start_threads(devices: Sequence[str], backend: Backend) -> list[ReplicaThread]:
    """A started ReplicaThread per device of `devices`, or none: where the OS refuses one, those already started
    are retired (a run on some would wait for the others for good) and a RuntimeError says how many started.

    Call it with interrupts deferred, and keep what it returns before they are let through: a Ctrl-C must not land
    between the threads' start and their owner's list.
    """
    threads: list[ReplicaThread] = []
    try:
        for replica_id, device in enumerate(devices):
            threads.append(ReplicaThread(replica_id, device, backend))
    except BaseException as exc:
        started = len(threads)
        retire_all(threads)
        if isinstance(exc, RuntimeError) and "thread" in str(exc):  # "can't start new thread"
            raise RuntimeError(
                f"Only {started} of the {len(devices)} replica threads could start ({exc}): this process reached "
                f"its limit of threads, or of memory for their stacks. Run fewer replicas, or raise the limit "
                f"(ulimit -u, /proc/sys/kernel/threads-max).") from exc
        raise
    return threads


def wake_all(threads: Sequence[ReplicaThread]) -> None:
    """Starts a phase on every thread of `threads`: wakes the first, and each wakes the next once it is awake.

    Woken all at once, the threads would find the GIL held by the one that woke first and go back to sleep
    waiting for it, two sleeps per thread per phase; woken in turn, each thread's wake-up overlaps the Python
    its predecessor runs, and it mostly finds the GIL free.
    """
    for worker, following in zip(threads, threads[1:]):
        worker.wake_next = following
    threads[-1].wake_next = None
    threads[0].go.release()


def executing_worker() -> ReplicaThread | None:
    """The ReplicaThread whose thread is calling, or None on any other thread."""
    return getattr(_executing, "worker", None)


def retire_all(threads: list[ReplicaThread]) -> None:
    """Ends every thread of `threads` (a dropped or closed strategy's); they exit once idle.

    A Ctrl-C arriving meanwhile (in `close`) is held until every thread is retired: part-way, it would leave the
    rest waiting for a run for good.
    """
    with deferred_interrupts():
        for worker in threads:
            worker.retire()
        threads.clear()


# A dropped strategy's threads are retired by a thread of their own, the reaper. Python code run where the strategy
# is dropped (a weakref.finalize) can be cut short by a Ctrl-C landing in it, which Python then only prints, and
# the threads not yet told would wait for a run for good; a queue's put, all in C, runs whole, and the Ctrl-C
# reaches the program's next line instead.
_dropped: queue.SimpleQueue = queue.SimpleQueue()  # weakrefs to dropped strategies
_watched: dict[weakref.ref, list[ReplicaThread]] = {}  # each strategy's thread list, by a weakref to it
_reaper: list[threading.Thread] = []  # this process's reaper thread, started with its first replica thread


def retire_when_dropped(owner: Any, threads: list[ReplicaThread]) -> None:
    """Retires the threads in `threads` (whatever the list holds then) once `owner` is dropped, without waiting for
    a garbage collection; call it once a thread exists, which starts the reaper."""
    _watched[weakref.ref(owner, _dropped.put)] = threads


def _start_reaper() -> None:
    """Starts this process's reaper unless it runs (a forked child starts its own; two started at once would only
    share the work)."""
    if not (_reaper and _reaper[0].is_alive()):
        _reaper[:] = [threading.Thread(target=_reap, daemon=True, name="distrib-reaper")]
        _reaper[0].start()


def _reap() -> None:
    while True:
        retire_all(_watched.pop(_dropped.get(), []))


def count_mismatch(run: Run) -> str:
    """MergeCallMismatchError's message: how many collectives each replica of `run` made."""
    counts = ", ".join(f"replica {i}: {c}{'+' if s == WAITING else ''}"
                       for i, (c, s) in enumerate(zip(run.merge_counts, run.status)))
    return (f"Replicas made different numbers of merge_call calls (each all_reduce, all_gather and variable "
            f"update is one), so some would wait forever. Calls so far: {counts} ('+' = waiting for more). Make "
            f"every replica call the same collectives, e.g. avoid all_reduce under a replica-dependent `if`.")


_NOTE = "distrib: raised in "


def name_replica(exc: BaseException, replica_id: int, count: int) -> None:
    """Adds the replica id to the exception's message, keeping its type and traceback.

    An exception object raised again (by another replica, or in a later run) is renamed, not named twice.
    """
    where = f"replica {replica_id} of {count}"
    if getattr(exc, "_distrib_named", None) is not None and exc.args == (exc._distrib_named,):
        message = exc._distrib_message  # named before, by distrib: rename
    elif type(exc).__str__ is BaseException.__str__ and len(exc.args) == 1 and isinstance(exc.args[0], str):
        message = exc.args[0]
    else:
        message = None
    if message is not None:
        exc.args = (f"{message} (raised in {where})",)
        exc._distrib_message, exc._distrib_named = message, exc.args[0]
    elif hasattr(exc, "add_note"):
        if getattr(exc, "__notes__", None):
            exc.__notes__[:] = [note for note in exc.__notes__ if not note.startswith(_NOTE)]
        exc.add_note(_NOTE + where)
    exc.replica_id = replica_id
