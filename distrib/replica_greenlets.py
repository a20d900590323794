"""Cooperative replicas: each replica function a greenlet on the thread that calls `Strategy.run`, switched out at
its collectives, so that a step costs no thread handoff at all.

The replicas of a phase run one after another in replica order, each until it reaches a collective or returns;
then the calling thread runs the merge, exactly as with replica threads, and resumes them in order. Nothing runs
beside a replica, so nothing can notice one that never comes back: runs with a deadline take the threads.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

from distrib import context, timeline
from distrib.errors import BackendUnavailableError, MergeCallMismatchError
from distrib.interrupts import deferred_interrupts
from distrib.options import replica_execution
from distrib.replica_threads import DONE, FAILED, WAITING, RequestedStop, Run, count_mismatch

_STOPPED = "stopped"


def _greenlet_module() -> Any:
    try:
        import greenlet
    except ImportError as exc:
        raise BackendUnavailableError("replica_execution='cooperative' runs the replicas as greenlets, but the "
                                      "greenlet package is not installed: pip install 'greenlet>=3.0'.") from exc
    return greenlet


class ReplicaGreenlets:
    """One greenlet per replica, bound to the thread that made them and reused from run to run.

    Args:
      count: the number of replicas.

    Example:
      >>> replicas = ReplicaGreenlets(2)
      >>> replicas
      <ReplicaGreenlets replicas=2 idle>
    """

    def __init__(self, count: int):
        self._module = _greenlet_module()
        self._mailbox = _Mailbox()
        self._greenlets = [self._module.greenlet(self._mailbox.serve) for _ in range(count)]
        self._stacks = [context.new_stack() for _ in range(count)]  # each replica's context stack
        self._own: tuple[list, str | None] = ([], None)  # the scheduler's context stack and timeline track
        self.run: Run | None = None
        self.running: int | None = None  # the replica switched to, None while the scheduler runs

    def __repr__(self) -> str:
        return f"<ReplicaGreenlets replicas={len(self._greenlets)} {'running' if self.run else 'idle'}>"

    def in_replica(self, replica_id: int | None = None) -> bool:
        """Whether the caller is replica `replica_id`'s greenlet (any of them for None) inside a run."""
        if self.run is None:
            return False
        current = self._module.getcurrent()
        if replica_id is None:
            return any(current is g for g in self._greenlets)
        return 0 <= replica_id < len(self._greenlets) and current is self._greenlets[replica_id]

    def execute(self, run: Run, merge: Callable[[Run], list], failed: Callable[[Run], None] | None = None) -> list:
        """Runs every replica of `run` to its end, with `merge(run)` at each collective; the results per replica.
        `failed(run)`, if given, sees a failed run as it stopped, before the replicas waiting at a collective
        unwind.

        Raises the first error in replica order (the replicas after it do not start that phase; those waiting
        at the collective are unwound first), and MergeCallMismatchError when some replicas returned while
        others wait at a collective.

        A Ctrl-C can land at any bytecode, in a replica or here, between a switch and what follows it: so each
        replica records its own status before it switches back, and a failed run puts the scheduler's context
        stack and track back whatever point of a switch it stopped at.
        """
        if self.run is not None:
            raise RuntimeError("ReplicaGreenlets.execute cannot nest: its greenlets are inside a run.")
        scheduler = self._module.getcurrent()
        for replica in self._greenlets:
            if replica.parent is not scheduler and not replica.dead:
                replica.parent = scheduler  # where a replica that dies of an interrupt raises it
        self._own = (context.thread_stack(), timeline.track_override())
        self._mailbox.scheduler, self.run = scheduler, run  # no call between here and `try`, so no Ctrl-C either
        try:
            self._phase(run, [(run, i) for i in range(len(self._greenlets))])
            while not all(status == DONE for status in run.status):
                if DONE in run.status:
                    raise MergeCallMismatchError(count_mismatch(run))
                self._phase(run, merge(run))
            return run.results
        except BaseException:
            with deferred_interrupts():  # every waiting replica unwinds, even under a second Ctrl-C
                if failed is not None:
                    failed(run)
                self._restore()
                self._stop(run)
                for stack in self._stacks:  # frames an interrupted unwinding left behind
                    stack[:] = context.new_stack()
            raise
        finally:
            self._mailbox.scheduler = self._mailbox.message = self.run = self.running = None
            self._own = ([], None)

    def rendezvous(self, replica_id: int, request: tuple) -> Any:
        """Called by a replica at a collective: hands control back until the merge, returns this replica's share."""
        run = self.run
        if run.stopped:
            raise RequestedStop()
        run.requests[replica_id] = request
        run.merge_counts[replica_id] += 1
        mailbox = self._mailbox
        with timeline.span(request[0], "merge_call"):
            run.status[replica_id] = WAITING
            mailbox.scheduler.switch()
        share, mailbox.message = mailbox.message, None
        return share

    def _phase(self, run: Run, messages: list) -> None:
        """Switches to each replica in turn with its message (its job, or its share of the merge)."""
        for i, message in enumerate(messages):
            self._switch(i, message)
            if run.status[i] == FAILED:
                raise run.error[1]  # not bound to a local: its traceback holds this frame, and would keep it

    def _stop(self, run: Run) -> None:
        """Unwinds the replicas waiting at a collective (their `finally` blocks run); they report back stopped."""
        run.stopped = True
        for i, status in enumerate(run.status):
            if status == WAITING and not self._greenlets[i].dead:
                self._switch(i, None, RequestedStop)

    def _switch(self, i: int, message: Any, throw: type[BaseException] | None = None) -> None:
        """Runs replica `i` with its own context stack until it switches back."""
        replica = self._greenlets[i]
        if replica.dead:  # ended by a Ctrl-C that landed outside its function, as it was switched to or back
            replica = self._greenlets[i] = self._module.greenlet(self._mailbox.serve)
        tracked = timeline.recording is not None  # then its events go on its replica's track
        context.set_stack(self._stacks[i])
        if tracked:
            timeline.set_track(f"replica {i}")
        self.running = i
        if throw is None:
            self._mailbox.message = message
            replica.switch()
        else:
            replica.throw(throw)
        self.running = None
        context.set_stack(self._own[0])
        if tracked:
            timeline.set_track(self._own[1])

    def _restore(self) -> None:
        """Makes the scheduler's context stack and track the thread's again."""
        context.set_stack(self._own[0])
        timeline.set_track(self._own[1])


class _Mailbox:
    """What the scheduler and the replica greenlets of one thread pass each other, and the replicas' loop.

    Messages pass through attributes rather than switch(), whose first call's arguments a greenlet keeps for its
    whole life. The idle replicas' frames hold this and nothing else: were they to hold their ReplicaGreenlets,
    which holds them, no collection could free a thread's replicas once the thread has ended.
    """

    __slots__ = ("scheduler", "message")

    def __init__(self):
        self.scheduler: Any = None  # the greenlet running `execute`, switched back to at each collective
        self.message: Any = None  # the job or merge share handed to the replica switched to

    def __repr__(self) -> str:
        return f"<_Mailbox {'in a run' if self.scheduler is not None else 'idle'}>"

    def serve(self) -> None:
        """A replica greenlet's life: run its function for each run it is switched to with, report, wait."""
        while True:
            (run, i), self.message = self.message, None
            try:
                with context.frame(run.strategy, run.contexts[i]), timeline.span("run", "run"):
                    result = run.fn(*run.args[i], **run.kwargs[i])
                run.results[i], run.status[i] = result, DONE
            except RequestedStop:
                run.status[i] = _STOPPED
            except BaseException as exc:  # noqa: BLE001 - GreenletExit too: the scheduler raises it from run
                if run.error is None and not run.stopped:
                    run.error = (i, exc)
                run.status[i] = FAILED
            run = result = None  # keep nothing of a finished run while waiting for the next
            if self.scheduler is None:  # collected while parked in a run that a second Ctrl-C cut short: end
                return
            self.scheduler.switch()


def thread_replicas(local: threading.local, count: int) -> ReplicaGreenlets:
    """The calling thread's ReplicaGreenlets in `local` (a strategy's), made on first use."""
    replicas = getattr(local, "replicas", None)
    if replicas is None:
        replicas = local.replicas = ReplicaGreenlets(count)
    return replicas


def runs_cooperatively(backend_name: str, devices: Sequence[str], execution: str | None) -> bool:
    """Whether the replicas run as greenlets: asked for (else $DISTRIB_REPLICA_EXECUTION), on the CPU emulator, or
    when asked for explicitly, on GPUs for replicas that all share one.

    GPU replicas on distinct GPUs keep their threads (each holds its device current); replicas sharing one GPU
    all use its stream, so they can take turns on the calling thread. The environment's choice applies to the
    emulator only, so one setting serves a job's CPU tests and its GPU runs alike.
    """
    chosen = replica_execution(execution)
    if chosen == "cooperative" and backend_name not in ("cpu", "mpi"):
        if execution is None:
            return False
        if len(set(devices)) > 1:
            raise ValueError(f"replica_execution='cooperative' needs the CPU emulator or replicas that share one GPU: "
                             f"replicas on distinct GPUs run on threads, each with its device current. Received: "
                             f"devices {list(devices)}.")
    return chosen == "cooperative"
