"""Runs of a single local replica on the calling thread: no replica thread to hand off to, each merge at once."""

from __future__ import annotations

import os
import threading

from distrib import context, timeline
from distrib.extended import NOT_NOW
from distrib.replica_context import ReplicaContext
from distrib.replica_threads import name_replica
from distrib.values import LEAF_TYPES, one_replica_args, regroup

# this process's id, kept current in a forked child: every run checks it, and os.getpid() is a system call
PID = [os.getpid()]
os.register_at_fork(after_in_child=lambda: PID.__setitem__(0, os.getpid()))


class InlineRuns:
    """MirroredExtended's runs with one local replica and no run deadline (one GPU; one process per GPU or per
    emulated device under mpirun). Nothing can run beside a single replica, so a thread for it would only add two
    handoffs (~100-150 µs) to every run and every merge_call.

    The strategy's state it uses: `_run_lock` (a reentrant lock, see `_run_at_once`), `_running_thread`, `_inline`
    (the replica context of the run on the calling thread), `_merge_error`, `_closed` and `_pid`.
    """

    def _run_at_once(self, fn, args, kwargs):
        """Strategy.run without options, with one local replica: `_run_inline` straight from it (each call left out
        costs microseconds right after a transfer has left the caches cold). NOT_NOW where the general path has
        more to do: a run in progress (nested or on another thread), a closed strategy, a fork, a timeline, a
        frame no run starts from as it is (a replica function, another strategy's scope: see `_run_inline`)."""
        if len(self._devices) != 1 or self._running_thread is not None or self._pid != PID[0] or \
                timeline.recording is not None:
            return NOT_NOW
        lock, acquired = self._run_lock, False
        try:
            # no `deferred_interrupts` (two system calls, a fifth of a 1 MB step's overhead): a Ctrl-C raised as
            # `acquire` returns leaves the lock held by this thread, which `_is_owned` tells below; one raised in
            # that `finally` too leaves a hold that this thread's next run takes again and drops whole
            acquired = lock.acquire(False)
            if not acquired or self._closed:  # the general path waits for the other run, or raises
                return NOT_NOW
            self._running_thread = threading.get_ident()
            return self._run_inline(fn, args, kwargs)
        finally:
            if acquired or lock._is_owned():
                self._running_thread = None
                lock._release_save()  # every hold this thread has (RLock's, as threading.Condition uses it)

    def _run_inline(self, fn, args, kwargs):
        """`fn` on the calling thread in the replica's context, the run lock held by the caller; NOT_NOW, having
        done nothing, where no run may start from the current frame (see `context.push_run`)."""
        strategy = self._strategy_ref()
        first = self._first_local_replica
        replica = ReplicaContext(strategy, first, first)
        pushed = context.push_run(strategy, replica)
        if pushed is None:
            return NOT_NOW
        stack, depth = pushed
        outer, self._inline = self._inline, replica
        try:
            selected = one_replica_args(args, True) if self._host_arrays and type(args) is tuple else None
            args = self._selected(args, 1)[0] if selected is None else selected  # its errors are not the replica's
            kwargs = self._selected(kwargs, 1)[0] if kwargs else {}
            try:
                if self._host_arrays:  # emulated devices have no current device to set
                    result = fn(*args, **kwargs)
                else:
                    with self._backend.device_scope(self._devices[0]):
                        result = fn(*args, **kwargs)
            except BaseException as exc:
                if exc is not self._merge_error:  # raised by the replica; a merge's error stays unnamed, as `_merge`
                    name_replica(exc, 0, 1)  # leaves it
                raise
        finally:
            del stack[depth:]
            self._inline, self._merge_error = outer, None
        return result if type(result) in LEAF_TYPES else regroup([result])  # one array: regroup's first rule

    def _merge_inline(self, kind, merge, *args):
        """`merge(*args)` in the cross-replica context, for the replica of the run on the calling thread (`_inline`):
        its collectives merge at once (`_rendezvous`; ReplicaContext.all_reduce of one value calls it only while a
        timeline records, for the span, and else calls the cross-device op itself)."""
        stack, depth = context.push(self._strategy_ref(), None)  # cross-replica
        try:
            if timeline.recording is None:
                return merge(*args)
            with timeline.span(kind, "merge_call"):
                return merge(*args)
        except BaseException as exc:
            self._merge_error = exc  # `_run_inline` leaves it unnamed, as `_merge` does
            raise
        finally:
            del stack[depth:]
