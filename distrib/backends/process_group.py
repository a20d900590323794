"""The processes of an MPI job as one group: bootstrap over mpi4py, waits bounded by a timeout, failed ranks named.

Before each collective a rank announces it to every peer with a tiny message on a communicator of its own, and
polls until every peer has announced it too; only then does it make the (blocking, fast) MPI call, which every
peer is about to make as well. So a rank that died or stalled before a collective cannot hang the others: past
the timeout, the ranks that never announced it are named in a DeadlineExceededError. (Open MPI's non-blocking
collectives, which could be polled directly, move large buffers 2 to 4 times slower than its blocking ones.) When `mpirun` tears a job down because a rank died, the survivors receive
SIGTERM; it becomes a WorkerFailedError naming the ranks (on this host) that are gone. After either fault the
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
import time
import weakref
from typing import Any, Sequence

import numpy as np

from distrib.errors import BackendUnavailableError, DeadlineExceededError, WorkerFailedError

_ANNOUNCE_TAG = 17
_SPIN_SECONDS = 0.05  # poll for peers without sleeping this long, as MPI's blocking calls do; then in 0.5 ms naps
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


class Channel:
    """An ordered stream of collectives on a communicator of its own, issued by one thread at a time.

    Collectives on one communicator must be issued in the same order on every rank; the training loop and the
    input pipeline's thread each get a channel, so their collectives cannot interleave differently on two ranks.
    """

    def __init__(self, group: "ProcessGroup", name: str):
        MPI = group.MPI
        self.group, self.name = group, name
        self.comm = MPI.COMM_WORLD.Dup()
        self._announcements = MPI.COMM_WORLD.Dup()
        self._sequence = 0
        self._seen = [0] * group.size
        self._seen[group.rank] = 1 << 62  # this rank never waits for itself
        self._sends: list[tuple[Any, np.ndarray]] = []
        self._lock = threading.Lock()

    def run(self, what: str, call: Any, timeout: float | None) -> None:
        """Announces collective `what`, waits until every peer has announced it, then makes it (`call()`)."""
        with self._lock:
            self.group.check_usable(what)
            self._sequence += 1
            self._announce()
            self._wait_for_peers(what, timeout)
            call()

    def _announce(self) -> None:
        stamp = np.array([self._sequence], np.int64)
        for peer in range(self.group.size):
            if peer != self.group.rank:
                self._sends.append((self._announcements.Isend(stamp, dest=peer, tag=_ANNOUNCE_TAG), stamp))

    def _collect_announcements(self) -> None:
        MPI, status, stamp = self.group.MPI, self.group.MPI.Status(), np.zeros(1, np.int64)
        while self._announcements.Iprobe(source=MPI.ANY_SOURCE, tag=_ANNOUNCE_TAG, status=status):
            source = status.Get_source()
            self._announcements.Recv(stamp, source=source, tag=_ANNOUNCE_TAG)
            self._seen[source] = max(self._seen[source], int(stamp[0]))
        if self._sends and MPI.Request.Testall([request for request, _ in self._sends]):
            self._sends.clear()

    def _wait_for_peers(self, what: str, timeout: float | None) -> None:
        group, sequence = self.group, self._sequence
        self._collect_announcements()
        if min(self._seen) >= sequence or group.size == 1:
            return
        begin = time.monotonic()
        limit = timeout if timeout is not None else _default_timeout()
        while True:
            self._collect_announcements()
            missing = tuple(r for r in range(group.size) if r != group.rank and self._seen[r] < sequence)
            if not missing:
                return
            waited = time.monotonic() - begin
            if waited > limit:
                group.broken = DeadlineExceededError(
                    f"{what} across processes timed out after {limit:g} s: {group.describe(missing)} never reached "
                    f"it (collective #{sequence} of the job's {self.name}). A rank that stalls, crashes or skips a "
                    f"collective stops the job; raise CommunicationOptions(timeout_seconds=...) if the work is just "
                    f"slow. Restart the job; `--resume` continues from the last checkpoint.",
                    operation=what, missing_ranks=missing, missing_replicas=group.replicas_of(missing))
                raise group.broken
            if waited > _SPIN_SECONDS:
                time.sleep(0.0005)
            else:
                os.sched_yield()  # the peer we wait for may need this core (more ranks than cores)


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
        self._collectives, self._input = Channel(self, "collectives"), Channel(self, "input checks")
        self.comm = self._collectives.comm  # the communicator `run`'s collectives use
        _GROUPS.add(self)
        _install_handlers()

    def run(self, what: str, call: Any, timeout: float | None) -> None:
        """Runs collective `what` on `comm`: once every rank has reached it, `call()` makes the MPI call(s).

        Raises:
          DeadlineExceededError: naming the ranks that never reached it within `timeout` seconds.
          WorkerFailedError: the job already failed.
        """
        self._collectives.run(what, call, timeout)

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
        here = socket.gethostname()
        return tuple(r for r in range(self.size) if r != self.rank and self.hosts[r] == here
                     and not _alive(self.pids[r]))

    def __repr__(self) -> str:
        return f"<ProcessGroup rank={self.rank} size={self.size} replicas={self.replica_counts}>"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _default_timeout() -> float:
    from distrib.options import default_timeout

    return default_timeout()


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
                                                           "or runs on another host)")
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
