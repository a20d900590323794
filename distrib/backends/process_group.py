"""The processes of an MPI job as one group: bootstrap over mpi4py, waits bounded by a timeout, failed ranks named.

Collectives run on channels (announcements.py): each is announced to every peer and made only once every peer
has announced it, so a rank that died or stalled before a collective is named in a DeadlineExceededError past the
timeout. When `mpirun` tears a job down (a rank died, or mpirun itself was interrupted), every rank receives
SIGTERM: in Python code it becomes a WorkerFailedError naming the ranks (on this host) that are gone, or saying
that none is; inside an MPI call, which cannot be interrupted, the watchdog thread (call_watchdog.py) prints that
error and ends the process. After any fault the group is broken: later collectives raise at once, and the process
aborts the MPI job when it exits instead of waiting in MPI_Finalize for a peer that will never come. A rank that
ends on an uncaught exception aborts the job too, so that its peers are told at once, not at their timeout. One
whose program ends normally first waits for the collectives it launched asynchronously (NCCL's, `drains`), so that
a peer that failed before one of them ends the job, with that collective's error, instead of MPI_Finalize hanging.
"""

from __future__ import annotations

import atexit
import itertools
import os
import signal
import socket
import sys
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import numpy as np

from distrib import timeline
from distrib.backends.announcements import Channel, missing_error
from distrib.backends.call_watchdog import RESTART, CallWatchdog
from distrib.backends.signatures import signature
from distrib.errors import BackendUnavailableError, WorkerFailedError
from distrib.install_hint import pip_install

_GROUPS: "weakref.WeakSet[ProcessGroup]" = weakref.WeakSet()
LINGER_SECONDS = 1.5  # how long a rank that mpirun is ending waits for its SIGKILL (1 s after SIGTERM; OMPI 5: 0.25 s)


def import_mpi() -> Any:
    """mpi4py's MPI module (which initialises MPI), or BackendUnavailableError saying what to install."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise BackendUnavailableError(f"Multi-worker strategies need mpi4py and an MPI library: "
                                      f"{pip_install('mpi')} (and e.g. apt-get install openmpi-bin libopenmpi-dev). "
                                      f"Received: {exc}.") from exc
    return MPI


class ProcessGroup:
    """This process's place among the ranks of the MPI job, and their replicas.

    Collectives go through `run` (the strategy's, issued from the thread that runs merges); the input
    pipeline's thread uses `any_rank_has` on a channel of its own.

    Args:
      num_local_replicas: replicas this process drives; every rank says how many it has.
    """

    def __init__(self, num_local_replicas: int):
        MPI = self.MPI = import_mpi()
        world = MPI.COMM_WORLD
        self.rank, self.size = world.Get_rank(), world.Get_size()
        # small Python objects, once: where every rank runs and how many replicas it drives
        peers = world.allgather((socket.gethostname(), os.getpid(), int(num_local_replicas)))
        self.hosts, self.pids, self.replica_counts = (tuple(column) for column in zip(*peers))
        self.first_replica = sum(self.replica_counts[:self.rank])
        self.num_replicas = sum(self.replica_counts)
        self.broken: BaseException | None = None
        self.ended_by_launcher: BaseException | None = None  # the error of mpirun's SIGTERM, once it came
        # called with the error when the watchdog ends this process, whose main thread is stuck in an MPI call and
        # so cannot report it (a command's last line: distrib train's resume command)
        self.last_words: list[Callable[[BaseException], None]] = []
        # called at exit, before MPI_Finalize: each returns once the collectives this rank launched asynchronously
        # (NCCL's) have completed, or raises the first one's failure (their deadlines bound the wait)
        self.drains: list[Callable[[], None]] = []
        oversubscribed = self.hosts.count(self.hosts[self.rank]) > (os.cpu_count() or 1)
        self.collectives = Channel(self, "collectives", oversubscribed)  # `run`'s (hot paths call its `run` directly)
        self._input = Channel(self, "input checks", oversubscribed)
        self.channels = (self.collectives, self._input)
        self.comm = self.collectives.comm  # the communicator `run`'s collectives use
        _GROUPS.add(self)
        _install_handlers()
        self.watchdog = CallWatchdog(self)
        if self.size > 1:
            self.watchdog.start()

    def run(self, what: str, call: Any, timeout: float | None, *args: Any, signature: int = 0) -> None:
        """Runs collective `what` on `comm`: once every rank has reached it, `call(*args)` makes the MPI call(s).
        `signature`: see `Channel.run`.

        Raises:
          DeadlineExceededError: naming the ranks that never reached it within `timeout` seconds.
          WorkerFailedError: the job already failed.
          CollectiveMismatchError: a peer on this host made it with another signature.
        """
        self.collectives.run(what, call, timeout, signature, *args)

    def gather_rows(self, rows: np.ndarray, timeout: float | None) -> np.ndarray:
        """Every rank's int64 `rows` (one per local replica, all of one width), in global replica order, by one MPI
        all-gather on the host: an all-gather's value sizes need no device copies and, on GPUs, no wait for them."""
        rows = np.ascontiguousarray(rows, np.int64)
        gathered = np.empty((self.num_replicas, rows.shape[1]), np.int64)
        int64 = self.MPI.INT64_T
        self.collectives.run("all_gather (sizes)", self.comm.Allgatherv, timeout,
                             signature("all_gather (sizes)", ((rows.shape[1], rows.dtype),)), [rows, int64],
                             [gathered, self.gather_counts(rows.shape[1]), int64])
        return gathered

    def gather_counts(self, per_replica: int) -> tuple[list[int], list[int]]:
        """(counts, displacements) by rank of an MPI all-gather of `per_replica` elements from every replica."""
        counts = [per_replica * n for n in self.replica_counts]
        return counts, list(itertools.accumulate(counts[:-1], initial=0))

    def say_last_words(self, error: BaseException) -> None:
        """Prints `error` as an uncaught exception would be, then calls `last_words` with it: for a process that
        ends on an error its program never saw (stuck in an MPI call, or at exit)."""
        sys.stderr.write(f"{type(error).__module__}.{type(error).__qualname__}: {error}\n")  # one write: ranks share it
        sys.stderr.flush()
        for report in self.last_words:  # the program's last line for a failure (distrib train's resume command)
            try:
                report(error)
            except Exception:  # noqa: BLE001 - nothing may keep the process from ending
                pass

    def announce(self, what: str = "a collective", timeout: float | None = None, lead: int | None = None) -> int:
        """Announces the next collective on `comm` without waiting for the peers; its number (see `missing`).

        For collectives launched asynchronously on another transport (NCCL): they do not block here, except that
        with `lead` this rank first waits (up to `timeout`) until no peer is more than `lead` collectives behind.

        Raises:
          DeadlineExceededError: a peer stayed more than `lead` collectives behind for `timeout` seconds.
          WorkerFailedError: the job already failed.
        """
        return self.collectives.announce(what, timeout, lead)

    def missing(self, sequence: int) -> tuple[int, ...]:
        """The ranks that have not announced collective `sequence` on `comm` (from `run` or `announce`) yet."""
        return self.collectives.missing(sequence)

    def missing_error(self, what: str, limit: float, sequence: int, missing: tuple[int, ...],
                      detail: str = "") -> BaseException:
        """The DeadlineExceededError of collective #`sequence` that `missing` never reached, or the
        WorkerFailedError naming those of them whose program ended; the group is broken."""
        channel = self.collectives
        self.broken = channel.left_error(what, sequence, missing) or \
            missing_error(channel, what, limit, sequence, missing, detail)
        return self.broken

    def barrier(self, what: str = "barrier", timeout: float | None = None) -> None:
        """Returns once every rank has reached the barrier; raises like any collective otherwise."""
        # every rank announced reaching it: that is the barrier (a peer that refused this collective: an error)
        self.run(what, lambda: None, timeout, signature=_BARRIER)

    def any_rank_has(self, flag: bool, timeout: float | None = None) -> bool:
        """Whether `flag` is true on any rank (the input pipeline's end-of-data vote), on the input channel."""
        mine, anywhere = np.array([int(flag)], np.int32), np.zeros(1, np.int32)
        channel = self._input
        channel.run("the end-of-input check", lambda: channel.comm.Allreduce(mine, anywhere, self.MPI.MAX), timeout,
                    0)
        return bool(anywhere[0])

    def check_usable(self, what: str) -> None:
        """Raises WorkerFailedError once the job has failed: no collective could complete."""
        if self.broken is not None:
            raise WorkerFailedError(f"{what} cannot run: this MPI job already failed. {self.broken}",
                                    ranks=getattr(self.broken, "ranks", getattr(self.broken, "missing_ranks", ())))

    # -- naming ----------------------------------------------------------------------------------------

    def replicas_of(self, ranks: Sequence[int]) -> tuple[int, ...]:
        """The global replica ids the given ranks drive."""
        firsts = np.cumsum((0,) + self.replica_counts)
        return tuple(i for r in ranks for i in range(firsts[r], firsts[r] + self.replica_counts[r]))

    def describe(self, ranks: Sequence[int]) -> str:
        """'rank 1 (pid 4242 on node7)', for each rank."""
        return ", ".join(f"rank {r} (pid {self.pids[r]} on {self.hosts[r]})" for r in ranks)

    def dead_local_ranks(self) -> tuple[int, ...]:
        """Ranks on this host whose process has exited (a zombie too: mpirun may not have reaped it yet)."""
        return self._local_peers_whose(lambda pid: not _alive(pid) or _state(pid) == "Z")

    def stopped_local_ranks(self) -> tuple[int, ...]:
        """Ranks on this host whose process is stopped (SIGSTOP, a debugger): they stall without dying."""
        return self._local_peers_whose(lambda pid: _state(pid) in ("T", "t"))

    def launcher_ending(self) -> tuple[str, tuple[int, ...], str]:
        """Why mpirun is ending the job (it sent SIGTERM), the ranks on this host that died, and what to do now.

        Only processes on this host can be looked at: when every rank runs here and none has died, mpirun itself
        was interrupted (Ctrl-C) or killed, and nothing needs restarting but the job.
        """
        dead = self.dead_local_ranks()
        if dead:
            return f"{self.describe(dead)} died", dead, RESTART
        if len(set(self.hosts)) == 1:
            return "no rank failed: mpirun itself was interrupted (Ctrl-C) or killed", (), ""
        return ("another rank failed (it raised an error, was killed, or runs on another host), or mpirun itself was "
                "interrupted (Ctrl-C) or killed"), (), RESTART

    def _local_peers_whose(self, condition: Any) -> tuple[int, ...]:
        """The other ranks on this host whose process id satisfies `condition` (only local pids can be looked at)."""
        here = socket.gethostname()
        return tuple(r for r in range(self.size) if r != self.rank and self.hosts[r] == here
                     and condition(self.pids[r]))

    def __repr__(self) -> str:
        return f"<ProcessGroup rank={self.rank} size={self.size} replicas={self.replica_counts}>"


_BARRIER = signature("barrier", ())  # every barrier alike, whatever it is for


def _state(pid: int) -> str:
    """The process's state letter from /proc ('R', 'S', 'T' stopped, ...); '' where there is no /proc entry."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_INSTALLED: list[bool] = []


def _install_handlers() -> None:
    """SIGTERM (mpirun ending the job) becomes a WorkerFailedError; a failed rank ends the job instead of hanging."""
    if _INSTALLED:
        return
    _INSTALLED.append(True)
    atexit.register(_end_at_exit)  # registered after mpi4py's finalizer, so it runs before it
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _on_terminate)


def _on_terminate(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process as usual
    for group in list(_GROUPS):
        who, dead, restart = group.watchdog.ending or group.launcher_ending()  # the watchdog looked as it came
        group.broken = group.ended_by_launcher = WorkerFailedError(
            f"{who}, and the MPI launcher is ending the job (SIGTERM to rank {group.rank}). {restart}".rstrip(),
            ranks=dead)
        raise group.broken
    raise SystemExit(128 + signum)


def _end_at_exit() -> None:
    """Ends a failed job now: MPI_Finalize would wait forever for a rank that failed or will never finalize.

    A rank whose program raised (Python sets `sys.last_value` for the uncaught exception it printed) exits with
    status 1 at once, so mpirun ends the job and every other rank gets a WorkerFailedError naming it; one that
    mpirun is already ending waits for mpirun to kill it. A rank that saw the job fail otherwise aborts it
    (MPI_Abort), which also ends a peer that stalled. A rank whose program ended normally first waits for the
    collectives it launched asynchronously (`drains`): one that fails there, which the program never saw (a peer
    stalled or died before it), is printed as an uncaught exception would be, and the job ends the same way.
    Otherwise it tells its peers that it left (`Channel.leave`): one still making collectives (its program does
    more than this one's did, or this one called `sys.exit`) raises WorkerFailedError naming it at once.
    """
    for group in list(_GROUPS):
        raised = group.size > 1 and getattr(sys, "last_value", None) is not None
        if not raised and group.ended_by_launcher is None:
            _drain(group)
            if group.broken is None:  # a peer still making collectives is told now, not at its timeout
                for channel in group.channels:
                    channel.leave()
        if group.broken is not None or raised:
            timeline.stop()  # the trace of a failed job is the one worth reading: this skips its atexit hook
            sys.stdout.flush()
            sys.stderr.flush()
            if group.ended_by_launcher is not None:
                # mpirun's SIGKILL follows its SIGTERM within a second: until then, stay, so that no peer still
                # handling that SIGTERM (its main thread busy in C code) finds this rank gone and names it the cause
                time.sleep(LINGER_SECONDS)
            if group.broken is None or group.ended_by_launcher is not None:
                os._exit(1)  # mpirun ends the job and reports which rank exited with which status
            group.comm.Abort(1)


def _drain(group: ProcessGroup) -> None:
    """Waits for `group`'s asynchronous collectives still in flight; their failure breaks the group, printed."""
    try:
        for drain in group.drains:
            drain()
    except BaseException as exc:  # a collective's error, or mpirun's SIGTERM meanwhile (then `ended_by_launcher`)
        group.broken = group.broken or exc
        group.say_last_words(exc)
