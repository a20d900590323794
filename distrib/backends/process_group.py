"""The processes of an MPI job as one group: bootstrap over mpi4py, waits bounded by a timeout, failed ranks named.

Collectives run on channels (announcements.py): each is announced to every peer and made only once every peer
has announced it, so a rank that died or stalled before a collective is named in a DeadlineExceededError past the
timeout. When `mpirun` tears a job down because a rank died, the survivors receive SIGTERM: in Python code it
becomes a WorkerFailedError naming the ranks (on this host) that are gone; inside an MPI call, which cannot be
interrupted, the watchdog thread (call_watchdog.py) prints that error and ends the process. After any fault the
group is broken: later collectives raise at once, and the process aborts the MPI job when it exits instead of
waiting in MPI_Finalize for a peer that will never come.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
import threading
import weakref
from typing import Any, Sequence

import numpy as np

from distrib.backends.announcements import Channel, missing_error
from distrib.backends.call_watchdog import CallWatchdog
from distrib.errors import BackendUnavailableError, WorkerFailedError

_GROUPS: "weakref.WeakSet[ProcessGroup]" = weakref.WeakSet()


def import_mpi() -> Any:
    """mpi4py's MPI module (which initialises MPI), or BackendUnavailableError saying what to install."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise BackendUnavailableError(f"Multi-worker strategies need mpi4py and an MPI library: pip install "
                                      f"'distrib[mpi]' (and e.g. apt-get install openmpi-bin libopenmpi-dev). "
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

    def run(self, what: str, call: Any, timeout: float | None, *args: Any) -> None:
        """Runs collective `what` on `comm`: once every rank has reached it, `call(*args)` makes the MPI call(s).

        Raises:
          DeadlineExceededError: naming the ranks that never reached it within `timeout` seconds.
          WorkerFailedError: the job already failed.
        """
        self.collectives.run(what, call, timeout, *args)

    def announce(self) -> int:
        """Announces the next collective on `comm` without waiting for the peers; its number (see `missing`).

        For collectives launched asynchronously on another transport (NCCL): they do not block here.
        """
        return self.collectives.announce()

    def missing(self, sequence: int) -> tuple[int, ...]:
        """The ranks that have not announced collective `sequence` on `comm` (from `run` or `announce`) yet."""
        return self.collectives.missing(sequence)

    def missing_error(self, what: str, limit: float, sequence: int, missing: tuple[int, ...],
                      detail: str = "") -> BaseException:
        """The DeadlineExceededError of collective #`sequence` that `missing` never reached; the group is broken."""
        self.broken = missing_error(self.collectives, what, limit, sequence, missing, detail)
        return self.broken

    def barrier(self, what: str = "barrier", timeout: float | None = None) -> None:
        """Returns once every rank has reached the barrier; raises like any collective otherwise."""
        self.run(what, lambda: None, timeout)  # every rank announced reaching it: that is the barrier

    def any_rank_has(self, flag: bool, timeout: float | None = None) -> bool:
        """Whether `flag` is true on any rank (the input pipeline's end-of-data vote), on the input channel."""
        mine, anywhere = np.array([int(flag)], np.int32), np.zeros(1, np.int32)
        channel = self._input
        channel.run("the end-of-input check", lambda: channel.comm.Allreduce(mine, anywhere, self.MPI.MAX), timeout)
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
        """Ranks on this host whose process no longer exists."""
        return self._local_peers_whose(lambda pid: not _alive(pid))

    def stopped_local_ranks(self) -> tuple[int, ...]:
        """Ranks on this host whose process is stopped (SIGSTOP, a debugger): they stall without dying."""
        return self._local_peers_whose(lambda pid: _state(pid) in ("T", "t"))

    def _local_peers_whose(self, condition: Any) -> tuple[int, ...]:
        """The other ranks on this host whose process id satisfies `condition` (only local pids can be looked at)."""
        here = socket.gethostname()
        return tuple(r for r in range(self.size) if r != self.rank and self.hosts[r] == here
                     and condition(self.pids[r]))

    def __repr__(self) -> str:
        return f"<ProcessGroup rank={self.rank} size={self.size} replicas={self.replica_counts}>"


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
    """SIGTERM (mpirun ending the job) becomes a WorkerFailedError; a broken job aborts instead of hanging at exit."""
    if _INSTALLED:
        return
    _INSTALLED.append(True)
    atexit.register(_abort_if_broken)  # registered after mpi4py's finalizer, so it runs before it
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _on_terminate)


def _on_terminate(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process as usual
    for group in list(_GROUPS):
        dead = group.dead_local_ranks()
        who = f"{group.describe(dead)} died" if dead else ("another rank failed (it raised an error, was killed, "
                                                           "or runs on another host), or mpirun itself was "
                                                           "interrupted (Ctrl-C) or killed")
        group.broken = WorkerFailedError(f"{who}, and the MPI launcher is ending the job (SIGTERM to rank "
                                         f"{group.rank}). Restart the job; `--resume` continues from the last "
                                         f"checkpoint.", ranks=dead)
        raise group.broken
    raise SystemExit(128 + signum)


def _abort_if_broken() -> None:
    for group in list(_GROUPS):
        if group.broken is not None:
            sys.stderr.flush()
            group.comm.Abort(1)  # MPI_Finalize would wait forever for the failed rank
