"""MirroredStrategy: one persistent thread per replica, and the rendezvous where merge_call runs cross-replica.

A `run` is a sequence of phases. In each phase every replica thread runs its function until it either returns
or reaches a collective (every collective is a merge_call); once all have reported, the calling thread runs
replica 0's merge function once, in the cross-replica context, hands each replica its share, and starts the
next phase. Replica threads run concurrently, as TensorFlow's replicas do inside a tf.function, so NumPy and
CuPy work in different replicas overlaps; Python state shared between replicas needs a lock. A single local
replica has nothing to overlap with: without a run deadline it runs on the calling thread.

Failure handling: the first exception in a replica (or in a merge function) stops the run; replicas waiting
at a collective are woken and unwound, and the exception reaches the caller of `run` with the replica id in
its message. A collective that some replicas never reach raises DeadlineExceededError after the timeout. A
replica thread that does not come back is retired and replaced, so the strategy stays usable.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Sequence

import numpy as np

from distrib import context, timeline
from distrib.backends import Backend, backend_for_devices
from distrib.backends.parallel import lend, lent_team
from distrib.cross_device_ops import CrossDeviceOps, default_cross_device_ops
from distrib.errors import ContextError, DeadlineExceededError, DistribError, MergeCallMismatchError
from distrib.extended import StrategyExtended
from distrib.inline_runs import PID, InlineRuns
from distrib.interrupts import deferred_interrupts
from distrib.options import CommunicationOptions, RunOptions, default_timeout
from distrib.replica_context import ReplicaContext
from distrib.replica_team import IdleThreadsTeam, ReplicaTeam
from distrib.replica_greenlets import runs_cooperatively, thread_replicas
from distrib.replica_threads import (DONE, WAITING, ReplicaThread, RequestedStop, Run, count_mismatch, executing_worker,
                                     name_replica, retire_all, retire_when_dropped, start_threads, wake_all)
from distrib.run_waits import POLL_SECONDS, patience, wait_for_phase
from distrib.strategy import Strategy
from distrib.thread_waits import wait_chain
from distrib.values import map_structure, regroup, select_replicas


class MirroredExtended(InlineRuns, StrategyExtended):
    """StrategyExtended of MirroredStrategy: replica threads, merge_call rendezvous, timeouts."""

    def __init__(self, container_strategy: Strategy, backend: Backend, devices: Sequence[str],
                 cross_device_ops: CrossDeviceOps, communication_options: CommunicationOptions,
                 execution: str | None = None):
        super().__init__(container_strategy, backend, devices, cross_device_ops, communication_options)
        self._cooperative = runs_cooperatively(backend.name, devices, execution)
        self._greenlets = threading.local()  # .replicas: each calling thread's ReplicaGreenlets
        self._cooperative_run: Any = None  # the ReplicaGreenlets of the cooperative run in progress
        self._threads: list[ReplicaThread] = []
        self._run_lock = threading.RLock()  # see `_run_at_once`
        self._running_thread: int | None = None
        self._inline: ReplicaContext | None = None  # the replica context of a run on the calling thread
        self._merge_error: BaseException | None = None  # the last error a merge raised in that run
        self._default_timeout = default_timeout()
        self._pid = PID[0]
        self._closed = False
        self._retired_when_dropped = False  # set with the first threads, which dropping the strategy ends at once

    def __repr__(self) -> str:
        return f"<{type(self).__name__} devices={self._devices}{' closed' if self._closed else ''}>"

    @property
    def replica_execution(self) -> str:
        """How this strategy's replicas run: "threads" (at the same time) or "cooperative" (one after another)."""
        return "cooperative" if self._cooperative else "threads"

    def _ensure_threads(self) -> list[ReplicaThread]:
        if self._pid != PID[0]:  # forked: the threads stayed in the parent process
            self._pid = PID[0]
            self._threads.clear()
        if not self._threads:
            with deferred_interrupts():  # all of them or none: a run on some would wait for the others for good
                self._threads.extend(start_threads(self._devices, self._backend))
                if not self._retired_when_dropped:  # the strategy holds no reference cycle: no collection needed
                    retire_when_dropped(self._container_strategy, self._threads)
                    self._retired_when_dropped = True
        return self._threads

    def _close(self) -> None:
        worker = executing_worker()
        if self._running_thread == threading.get_ident() or (
                worker is not None and worker.current is not None and worker.current.strategy is self._strategy_ref()):
            replica = context.get_replica_context()
            where = "a merge_fn" if replica is None else f"replica {replica.replica_id_in_sync_group}'s function"
            raise ContextError(f"Strategy.close cannot be called inside the strategy's own run (in a replica function "
                               f"or a merge_fn), which holds the strategy until it returns. Received: a call from "
                               f"{where}, on thread {threading.current_thread().name!r}. Close it after run returns.")
        if self._pid != PID[0]:  # forked during another thread's run: that thread and its lock are gone
            self._run_lock, self._running_thread = threading.RLock(), None
        acquired = False
        try:
            while not acquired:  # waits for a run in progress on another thread to end, unless it waits for us
                with deferred_interrupts():  # so that a Ctrl-C cannot land between taking the lock and `acquired`
                    acquired = self._run_lock.acquire(False) or self._run_lock.acquire(timeout=POLL_SECONDS)
                if not acquired:
                    self._refuse_a_wait_forever(
                        "Strategy.close cannot return", "Close the strategy after its run returns, from the thread "
                        "that called run.")
            self._closed = True
            if self._pid == PID[0]:
                retire_all(self._threads)
        finally:
            if acquired:
                self._run_lock.release()

    def _call_for_each_replica(self, fn, args, kwargs, options: RunOptions | None = None):
        run_timeout = None if options is None else options.timeout_seconds
        started = time.monotonic()
        deadline = None if run_timeout is None else started + run_timeout
        inline = deadline is None and len(self._devices) == 1  # nothing to overlap, no deadline to keep
        if self._running_thread == threading.get_ident():
            if self._cooperative_run is not None and self._cooperative_run.in_replica():
                raise ContextError("Strategy.run cannot be called inside a replica function of the same "
                                   "strategy's run: call the function directly, or run it after this run returns.")
            # run from a merge_fn: the replica threads wait in the merge, so this run gets threads of its own
            # (TensorFlow starts threads for every run, so nesting works there too)
            if inline:
                return self._run_inline(fn, args, kwargs)
            threads: list[ReplicaThread] = []
            try:
                with deferred_interrupts():  # all of them or none, and each one retired below
                    threads.extend(start_threads(self._devices, self._backend))
                return self._run(fn, args, kwargs, threads, deadline)
            finally:
                retire_all(threads)
        if self._pid != PID[0]:  # forked during another thread's run: that thread and its lock are gone
            self._run_lock, self._running_thread = threading.RLock(), None
        wait = self._default_timeout if run_timeout is None else run_timeout
        acquired = False
        try:
            while not acquired:
                with deferred_interrupts():  # so that a Ctrl-C cannot land between taking the lock and `acquired`
                    acquired = self._run_lock.acquire(False) or self._run_lock.acquire(timeout=POLL_SECONDS)
                if not acquired:
                    self._refuse_a_wait_forever(
                        "Strategy.run cannot start", "Runs of one strategy cannot nest from a thread that a replica "
                        "function waits on: return what the thread computed and call run after the run in progress "
                        "returns, or call the function directly in the replica function.")
                if not acquired and time.monotonic() - started >= wait:
                    raise DeadlineExceededError(
                        f"Strategy.run waited {wait:g} s for this strategy's run in progress on another thread to "
                        f"end. Runs of one strategy take turns; a run started from a thread that a replica "
                        f"function waits for can never start: call run from the thread that runs the others, "
                        f"after they return.", operation="run")
            if self._closed:
                raise ContextError(f"{self._container_strategy!r} is closed: create a new strategy to run again.")
            self._running_thread = threading.get_ident()
            if inline and timeline.recording is None:  # skips a span that records nothing (3 calls, cold caches)
                return self._run_inline(fn, args, kwargs)
            with timeline.span("run", "run"):
                if inline:
                    return self._run_inline(fn, args, kwargs)
                if self._cooperative and deadline is None:
                    return self._run_cooperative(fn, args, kwargs)
                return self._run(fn, args, kwargs, self._ensure_threads(), deadline)
        finally:
            if acquired:
                self._running_thread = None
                self._run_lock.release()

    def _refuse_a_wait_forever(self, refusal: str, advice: str) -> None:
        """ContextError, `refusal` then `advice`, if the run in progress waits, without a timeout, for the thread
        that waits for it to end (to run or to close the strategy)."""
        holder = self._running_thread
        waiters = [worker.thread.ident for worker in list(self._threads)] + ([holder] if holder else [])
        cooperative = self._cooperative_run
        running = None if cooperative is None else cooperative.running
        notes = {} if running is None else {holder: f"(replica {running})"}
        chain = wait_chain(waiters, threading.get_ident(), notes)
        if chain is not None:
            raise ContextError(
                f"{refusal} on this thread: the strategy's run in progress waits for it, so neither could ever "
                f"end ({'; '.join(chain)}). {advice}")

    def _new_run(self, fn, args, kwargs, deadline: float | None) -> Run:
        # new replica contexts for every run: kept by the strategy, they would hold it in a reference cycle
        count, strategy, first = len(self._devices), self._container_strategy, self._first_local_replica
        return Run(strategy, tuple(ReplicaContext(strategy, first + i, first) for i in range(count)), fn,
                   self._selected(args, count), self._selected(kwargs, count), self._default_timeout, deadline)

    def _selected(self, structure: Any, count: int) -> list[Any]:
        """Each local replica's part of run's args or kwargs. On GPUs, NumPy arrays among them are uploaded to the
        replica's device, as TensorFlow converts them to tensors there: a CuPy operation refuses a host array."""
        selected = select_replicas(structure, count)
        if self._host_arrays or not structure:
            return selected
        return [map_structure(lambda leaf, d=device: self._backend.to_device(leaf, d)
                              if isinstance(leaf, np.ndarray) else leaf, part)
                for part, device in zip(selected, self._devices)]

    def _run(self, fn, args, kwargs, threads: list[ReplicaThread], deadline: float | None):
        count = len(self._devices)
        run = self._new_run(fn, args, kwargs, deadline)
        try:
            with deferred_interrupts():  # every thread starts, or (interrupted before) none
                for worker in threads:
                    worker.run = run
                wake_all(threads)
            while True:
                wait_for_phase(run, threads)
                if run.error is not None:
                    raise run.error[1]
                if all(s == DONE for s in run.status):
                    break
                if any(s == DONE for s in run.status):
                    raise MergeCallMismatchError(count_mismatch(run))
                merged = self._merge(run, threads)
                with deferred_interrupts():  # every waiting replica resumes, or none does
                    run.merge_results = merged
                    run.begin_phase()
                    wake_all(threads)
            return regroup(run.results)
        except BaseException as exc:
            self._abandon_collective(run)
            self._stop(run, threads, patience(run, exc))
            if run.error is not None and exc is run.error[1] and run.error[0] is not None:
                name_replica(exc, run.error[0], count)
            raise
        finally:
            for worker in threads:
                worker.run = None
            run.drop_references()

    def _run_cooperative(self, fn, args, kwargs):
        """Every replica a greenlet on the calling thread (`replica_execution="cooperative"`); the replica threads
        only share the merges' sums, as they do in a threaded run's merge."""
        count = len(self._devices)
        run = self._new_run(fn, args, kwargs, None)
        replicas = thread_replicas(self._greenlets, count)
        threads = self._ensure_threads()
        self._cooperative_run = replicas
        try:
            # replicas sharing one GPU: its device and stream current while they run (emulated devices have none)
            with contextlib.nullcontext() if self._host_arrays else self._backend.device_scope(self._devices[0]):
                return regroup(replicas.execute(run, lambda run: self._merge(run, threads), self._abandon_collective))
        except BaseException as exc:
            if run.error is not None and exc is run.error[1] and run.error[0] is not None:
                name_replica(exc, run.error[0], count)
            raise
        finally:
            self._cooperative_run = None
            run.drop_references()

    def _abandon_collective(self, run: Run) -> None:
        """Where the run fails (a replica raised, or returned while others wait) with replicas of this process
        waiting at a collective it will now never make, refuses that collective: the peer processes that made it
        raise CollectiveMismatchError instead of pairing it with this process's next one (wrong sums). Not where
        the merge itself failed: it made, or refused, its collective. Nothing in one process."""
        if run.error is not None and run.error[0] is None:
            return
        if any(s == WAITING and r is not None and r[0] != "merge_call" for s, r in zip(run.status, run.requests)):
            with contextlib.suppress(DistribError):  # a job already broken: the run's own error says more
                self._refuse_collective()

    def _merge(self, run: Run, threads: list[ReplicaThread]) -> list:
        kinds = [r[0] for r in run.requests]
        if len(set(kinds)) > 1:
            detail = ", ".join(f"replica {i}: {k}" for i, k in enumerate(kinds))
            raise MergeCallMismatchError(f"Replicas reached different collectives at the same point; every "
                                         f"replica must call them in the same order. Received: {detail}.")
        merge = run.requests[0][1]
        try:
            with context.frame(self._container_strategy, None), lend(ReplicaTeam(threads)), \
                    timeline.span(kinds[0], "merge_call"):
                return list(merge([r[2] for r in run.requests]))
        except BaseException as exc:
            run.fail(None, exc)
            raise

    def _stop(self, run: Run, threads: list[ReplicaThread], patience: float) -> None:
        """Wakes replicas waiting at a collective so they unwind; replaces the threads that do not come back.

        Waits up to `patience` seconds for replicas still in user code to stop (a Ctrl-C cuts the wait short);
        every step that changes the threads runs whole, so a second Ctrl-C cannot leave them half stopped.
        """
        with deferred_interrupts():
            with run.lock:
                run.stopped = True
                waiting = [i for i, s in enumerate(run.status) if s == WAITING]
            for i in waiting:
                threads[i].go.release()
        try:
            run.wait_until_all_left(patience)
        finally:
            with deferred_interrupts():
                self._replace_late(run, threads)

    def _replace_late(self, run: Run, threads: list[ReplicaThread]) -> None:
        with run.lock:
            late = [i for i, left in enumerate(run.left) if not left]
        try:
            for i in late:  # still inside user code: it ends on its own, and takes no further run
                threads[i].retire()
                threads[i] = ReplicaThread(i, self._devices[i], self._backend)
        except BaseException:  # no thread to replace it: closed, rather than half usable
            self._closed = True
            retire_all(threads)
            raise

    def _batch_reduce_to(self, op, pairs, options):
        if len(self._threads) < 2:  # nothing to lend (one replica per process): straight on, as `_on_idle_threads`
            return super()._batch_reduce_to(op, pairs, options)
        return self._on_idle_threads(super()._batch_reduce_to, op, pairs, options)

    def _reduce_to_host(self, op, leaves, axis):
        return self._on_idle_threads(super()._reduce_to_host, op, leaves, axis)

    def _on_idle_threads(self, reduction: Any, *args: Any) -> Any:
        """`reduction(*args)` with the replica threads lent to it, so that a reduction called outside a run splits
        its sums as a merge does; they are taken only for a call big enough to split, and only while no run holds
        them. Inside a merge the merge's own team stays lent; one thread has nothing to split with, a forked
        child no threads; then no context is entered at all (it would cost ~10 µs a call)."""
        if len(self._threads) < 2 or lent_team() is not None or self._pid != PID[0]:
            return reduction(*args)
        with lend(IdleThreadsTeam(self._threads, self._run_lock)):
            return reduction(*args)

    def _rendezvous(self, replica_id, kind, merge, payload, options):
        inline = self._inline
        if inline is not None and self._running_thread == threading.get_ident() and \
                context.get_replica_context() is inline:  # a run on the calling thread: the merge runs at once
            return self._merge_inline(kind, merge, [payload])[0]
        cooperative = self._cooperative_run
        if cooperative is not None and cooperative.in_replica(replica_id):
            return cooperative.rendezvous(replica_id, (kind, merge, payload, options.timeout))
        worker = executing_worker()
        run = None if worker is None else worker.current
        if run is None or run.strategy is not self._container_strategy or worker.replica_id != replica_id:
            raise ContextError(f"{kind} must be called from the replica function that Strategy.run is running.")
        if run.stopped or worker.retired:
            raise RequestedStop()
        return worker.rendezvous(run, (kind, merge, payload, options.timeout))


class MirroredStrategy(Strategy):
    """Synchronous data parallelism: one replica per device, variables mirrored, collectives reduce across them.

    Args:
      devices: device names such as `["GPU:0", "GPU:1"]` or `["CPU:0", "CPU:1", "CPU:2", "CPU:3"]` (emulated);
        None means every GPU when the CUDA backend can run, else `$DISTRIB_CPU_REPLICAS` (default 2) emulated
        CPU devices.
      cross_device_ops: a `NcclAllReduce` (default), `HierarchicalCopyAllReduce` or `ReductionToOneDevice`.
      communication_options: default `CommunicationOptions` for every collective.
      replica_execution: "threads" (one thread per replica, the default) or "cooperative" (emulated CPU
        replicas, or replicas that all share one GPU: each a greenlet on the calling thread, run one after another
        up to each collective, with no thread handoff per step and no concurrency between replicas); None reads
        `$DISTRIB_REPLICA_EXECUTION` (which applies to emulated replicas only). A cooperative replica that never
        comes back stalls its run, and a run with a deadline (`RunOptions(timeout_seconds=...)`) uses the threads.

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
                 communication_options: CommunicationOptions | None = None, *, replica_execution: str | None = None):
        backend, devices = backend_for_devices(devices)
        if cross_device_ops is None:
            cross_device_ops = default_cross_device_ops(backend)
        elif not isinstance(cross_device_ops, CrossDeviceOps):
            raise TypeError(f"cross_device_ops must be a CrossDeviceOps such as distrib.NcclAllReduce(). Received: "
                            f"{type(cross_device_ops).__name__}.")
        communication_options = checked_communication_options(communication_options)
        super().__init__(MirroredExtended(self, backend, devices, cross_device_ops, communication_options,
                                          replica_execution))


def checked_communication_options(options: CommunicationOptions | None) -> CommunicationOptions:
    """`options`, or the defaults for None; TypeError for anything else."""
    if options is None:
        return CommunicationOptions()
    if not isinstance(options, CommunicationOptions):
        raise TypeError(f"communication_options must be a CommunicationOptions. Received: {type(options).__name__}.")
    return options
