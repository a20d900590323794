"""Collectives across MPI ranks that cannot hang on a missing peer: each is announced to every peer, then made.

Before a collective a rank announces its number to every peer, then polls until every peer has announced it
too; only then does it make the blocking, fast MPI call, which every peer is about to make as well. A peer that
never announces it within the timeout is named in a DeadlineExceededError. Peers on the same host read the number
from a slot in memory they share (a file they all map): one store to announce, one load per peer to check, no
MPI call. Peers on other hosts get it as a 16-byte message (restarting one persistent send per peer, polling
pre-posted persistent receives). With the number travels the collective's signature (what it moves): where two
ranks' differ, every rank raises CollectiveMismatchError instead of making the call. At 1 MB across two
processes here (timed right after a barrier, caches cold), messages cost about 9 µs per collective and slots
about 5 µs, the call's lock and its record for the watchdog included. `$DISTRIB_MPI_ANNOUNCEMENTS=messages` sends
messages to every peer. (Open MPI's non-blocking collectives, which could be polled directly, moved a 1 MB buffer
3-5 times slower than its blocking ones in back-to-back loops, and 25-30 % slower timed call by call after a
barrier: either way more than an announcement costs.)

The wait spins, as MPI's own blocking calls do: yielding the core to whatever else runs there (the peer is on
another core) delays the collective by a scheduler time slice when the machine is busy. It yields only when a
host runs more ranks than it has cores, and naps once a peer is more than `SPIN_SECONDS` late.
"""

from __future__ import annotations

import array
import functools
import mmap
import os
import tempfile
import threading
import time
from typing import Any, Callable, NamedTuple

from distrib.backends.call_watchdog import RESTART
from distrib.backends.signatures import NUMBER, REFUSED, cell_signature, cell_word, differs
from distrib.errors import CollectiveMismatchError, DeadlineExceededError, WorkerFailedError
from distrib.options import default_timeout

_TAG = 17
ANNOUNCEMENTS_VARIABLE = "DISTRIB_MPI_ANNOUNCEMENTS"  # "messages": no shared-memory slots, messages to every peer
ANNOUNCEMENTS = ("shared-memory", "messages")  # its values; unset or empty: the first
_SLOT_BYTES = 64  # a cache line per rank: a slot shares its line with no other rank's
_CHECK_SENDS_EVERY = 32
QUICK_POLLS = 64  # polls made before the wait looks at the clock: a peer in step announces within microseconds
SPIN_SECONDS = 0.05  # a late peer is polled without pause this long, then every NAP_SECONDS
NAP_SECONDS = 0.0005
LEFT_CHECK_SECONDS = 0.001  # a wait looks for peers that left once it has lasted this long


def announcements() -> str:
    """How collectives are announced to the peers on this host, from $DISTRIB_MPI_ANNOUNCEMENTS: "shared-memory" (a
    slot in a file they all map; the default) or "messages" (as to other hosts' peers). Read as DISTRIB_BACKEND is:
    case and surrounding spaces aside.

    Raises:
      ValueError: it is set to anything else, naming it.
    """
    raw = os.environ.get(ANNOUNCEMENTS_VARIABLE, "")
    value = raw.strip().lower() or ANNOUNCEMENTS[0]
    if value not in ANNOUNCEMENTS:
        raise ValueError(f"{ANNOUNCEMENTS_VARIABLE} must be 'shared-memory' or 'messages'. Received: {raw!r}.")
    return value


class InCall(NamedTuple):
    """The MPI call a channel is inside: read by the group's watchdog thread while the calling thread is in MPI."""

    operation: str
    sequence: int
    started: float  # time.monotonic()
    timeout: float | None


# InCall((...)) without the Python-level __new__ of a NamedTuple: every collective records one
_in_call = functools.partial(tuple.__new__, InCall)


class Channel:
    """An ordered stream of collectives on a communicator of its own, issued by one thread at a time.

    Collectives on one communicator must be issued in the same order on every rank; the training loop and the
    input pipeline's thread each get a channel, so their collectives cannot interleave differently on two ranks.

    Args:
      group: the ProcessGroup (its MPI module, rank, size, `check_usable`, `describe`, `replicas_of`).
      name: what the channel carries, for error messages ("collectives").
      oversubscribed: whether this host runs more ranks than it has cores (waits then yield the core).
    """

    def __init__(self, group: Any, name: str, oversubscribed: bool = False):
        slots_wanted = announcements() == "shared-memory"  # before any MPI call: every rank refuses a bad value alike
        MPI = group.MPI
        self.group, self.name, self._yield = group, name, oversubscribed
        # polls made at once: on a shared core (oversubscribed) spinning only delays the peer
        self._quick_polls = range(0 if oversubscribed else QUICK_POLLS)
        self.comm = MPI.COMM_WORLD.Dup()
        self._board = MPI.COMM_WORLD.Dup()
        self.sequence = 0  # collectives announced so far
        self.in_call: InCall | None = None
        slots = _shared_slots(MPI, self._board, slots_wanted)
        self._slot = slots.get(group.rank)  # this rank's last announcement, read by the peers on its host
        self._near = tuple(r for r in range(group.size) if r != group.rank and r in slots)
        self._near_slots = tuple(slots[r] for r in self._near)  # theirs
        self._peers = tuple(r for r in range(group.size) if r != group.rank and r not in slots)  # by message
        self._seen = [0] * len(self._peers)  # the last collective each of them announced
        self._signatures = [0] * len(self._peers)  # its signature
        # Python arrays, not NumPy: after a large transfer has evicted the interpreter's working set from the
        # caches, every distinct piece of code a collective runs costs cache misses (NumPy's scalar paths
        # cost microseconds there); persistent requests likewise spare building a request per message
        self._inboxes = [array.array("q", [0, 0]) for _ in self._peers]  # (number, signature)
        self._receives = [self._board.Recv_init([inbox, MPI.INT64_T], source=peer, tag=_TAG)
                          for inbox, peer in zip(self._inboxes, self._peers)]
        self._stamp = array.array("q", [0, 0])  # the announcement sent to every peer by `_stamp_sends`
        self._stamp_sends = [self._board.Send_init([self._stamp, MPI.INT64_T], dest=peer, tag=_TAG)
                             for peer in self._peers]
        if self._receives:
            MPI.Prequest.Startall(self._receives)
        self._sends: list[Any] = []  # announcements sent while the stamp's were in flight, not known complete
        self._stamps: list[array.array] = []  # their buffers
        self._lock = threading.Lock()

    def run(self, what: str, call: Callable[..., Any], timeout: float | None, signature: int, *args: Any) -> None:
        """Announces collective `what`, waits until every peer has announced it, then makes it (`call(*args)`).

        `signature` (0: none; else an integer equal on every rank for the same collective, from `signature`)
        travels with the announcement; where a peer's is another nonzero one, or the peer refused the collective
        (`refuse`), no rank makes the call and each raises CollectiveMismatchError.

        Raises:
          DeadlineExceededError: naming the ranks that never announced it within `timeout` seconds.
          WorkerFailedError: the job already failed, or a peer's program ended before it (naming the peer).
          CollectiveMismatchError: a peer announced this collective with another nonzero signature, or refused it.
        """
        with self._lock:
            if self.group.broken is not None:
                self.group.check_usable(what)
            if self._peers or self._slot is None:
                self._announce_and_wait(what, timeout, signature)
            else:  # every peer on this host: `_announce` and `_missing` for slots alone, inline
                self.sequence = sequence = self.sequence + 1
                cell = 2 - (sequence & 1)  # see `_shared_slots`
                mine = signature << 16 | sequence & NUMBER  # `cell_word` inline: it runs on every collective
                self._slot[cell] = mine  # before the number: a peer that reads the number reads it too
                self._slot[0] = sequence
                slots = self._near_slots
                # a peer's store takes a few hundred ns to reach this core, so ranks that arrive together each find
                # the other late at first: a tight loop sees it arrive (the general wait's first polls took 2-3 µs
                # of a 1 MB call, with cold caches)
                for _ in self._quick_polls:
                    for slot in slots:
                        if slot[0] < sequence:
                            break
                    else:
                        break
                else:
                    self._wait_for_peers(what, timeout)
                if signature:
                    for slot in slots:
                        theirs = slot[cell]
                        if theirs != mine and differs(theirs, sequence, signature):
                            raise self._mismatch(what, sequence, signature)
            self.in_call = _in_call((what, self.sequence, time.monotonic(), timeout))
            try:
                call(*args)
            finally:
                self.in_call = None

    def _mismatch(self, what: str, sequence: int, mine: int) -> CollectiveMismatchError:
        """The error of collective #`sequence`, which this rank announced with signature `mine`, and some peers
        with another nonzero one, or refused."""
        cell = 2 - (sequence & 1)
        theirs = [(peer, cell_signature(slot[cell], sequence)) for peer, slot in zip(self._near, self._near_slots)] + \
            list(zip(self._peers, self._signatures))
        other = tuple(sorted(peer for peer, signature in theirs if signature not in (mine, 0, REFUSED)))
        refused = tuple(sorted(peer for peer, signature in theirs if signature == REFUSED))
        group, said = self.group, []
        if other:
            said.append(f"{group.describe(other)} made collective #{sequence} of the job's {self.name} with other "
                        f"values than this rank (another size, shape, dtype, number of values or reduce op)")
        if refused:
            said.append(f"{group.describe(refused)} refused it: it raised on its own values first (its replicas "
                        f"disagreed, or a value could not be reduced or gathered), or its run failed while its "
                        f"replicas waited at it (one raised, or returned without it)")
        return CollectiveMismatchError(
            f"{what} across processes: {'; '.join(said)}; so no rank made it. Every process must pass values of the "
            f"same structure, shapes and dtypes, and the same op, to each collective, in the same order.")

    def refuse(self, timeout: float | None = None) -> None:
        """Announces the next collective as one this rank will not make, because its values were refused before
        they reached it (its own replicas disagreed, a value could not be reduced): every peer that reaches it
        raises CollectiveMismatchError instead of making it, so that this rank's next collective does not pair with
        it.

        Waits until every peer has reached it, as a collective does: a rank that went on at once could announce two
        collectives past a peer still reading its slot for this one. Where a peer does not within `timeout` (it
        died, or stalled) the group is broken, and this rank's next collective raises the error.
        """
        with self._lock:
            if self.group.broken is None:
                self._announce(REFUSED)
                try:
                    self._wait_for_peers("a refused collective", timeout)
                except (DeadlineExceededError, WorkerFailedError):
                    pass  # `group.broken` holds it

    def _announce_and_wait(self, what: str, timeout: float | None, signature: int) -> None:
        """`run`'s announcement, wait and comparison of signatures where some peers hear it by message."""
        self._announce(signature)
        sequence, seen = self.sequence, self._seen
        late = False  # `_missing` inline: the last rank to arrive finds every peer's announcement here, and
        for slot in self._near_slots:  # makes the call at once
            if slot[0] < sequence:
                late = True
                break
        for k, receive in enumerate(self._receives):
            if 0 <= seen[k] < sequence and receive.Test():  # negative: the peer left (see `leave`)
                seen[k], self._signatures[k] = self._inboxes[k]
                if seen[k] >= 0:
                    receive.Start()
        if (late or seen and min(seen) < sequence) and self._missing():
            self._wait_for_peers(what, timeout)
        if signature:
            cell = 2 - (sequence & 1)
            if any(differs(slot[cell], sequence, signature) for slot in self._near_slots) or \
                    any(theirs != signature and theirs for theirs in self._signatures):
                raise self._mismatch(what, sequence, signature)

    def announce(self, what: str = "a collective", timeout: float | None = None, lead: int | None = None) -> int:
        """Announces the next collective without waiting for the peers to reach it; returns its number.

        For collectives that are launched asynchronously (NCCL's): a timeout then asks `missing`. With `lead`, it
        first waits until every peer has announced the collective `lead` before this one, so that this rank never
        runs more than `lead` collectives ahead of any peer: a program that never waits for its results still
        meets a peer that stalled or died at its next collectives, in Python code, where it can catch the error.

        Raises:
          DeadlineExceededError: naming the ranks that had not announced that earlier collective within `timeout`.
          WorkerFailedError: the job already failed, or a peer's program ended before that collective.
        """
        with self._lock:
            if self.group.broken is not None:
                self.group.check_usable(what)
            self._announce(0)
            missing = self._missing()  # takes in what has arrived, so that nothing piles up
            # a peer that left reads as far behind: the wait then tells whether it left before that collective
            if missing and lead is not None and \
                    min([slot[0] for slot in self._near_slots] + self._seen) < self.sequence - lead:
                self._wait_for_peers(what, timeout, self.sequence - lead)
            return self.sequence

    def missing(self, sequence: int) -> tuple[int, ...]:
        """The peers that have not announced collective `sequence` yet (callable from any thread)."""
        if not self._lock.acquire(timeout=1.0):  # the caller's thread waits at a collective: read what it saw
            return tuple(sorted(peer for peer, seen in self._announced() if _last_announced(seen) < sequence))
        try:
            return self._missing(sequence)
        finally:
            self._lock.release()

    def leave(self) -> None:
        """Tells every peer that this rank's program has ended, after its last collective: a peer that waits for a
        later one raises WorkerFailedError naming this rank at once, instead of DeadlineExceededError at its
        timeout. Called as the program exits normally (`sys.exit` too), before MPI_Finalize."""
        with self._lock:
            marker = _left_after(self.sequence)
            if self._slot is not None:
                self._slot[0] = marker
            if self._peers:
                self._send_from_own_buffer(marker)

    def _announced(self) -> list[tuple[int, int]]:
        """(peer, what it last announced as far as this rank has seen: a collective's number, or `_left_after`'s
        negative marker once it left), for every peer."""
        return [(peer, slot[0]) for peer, slot in zip(self._near, self._near_slots)] + list(zip(self._peers,
                                                                                               self._seen))

    def _announce(self, signature: int) -> None:
        self.sequence = sequence = self.sequence + 1
        if self._slot is not None:
            self._slot[2 - (sequence & 1)] = cell_word(signature, sequence)
            self._slot[0] = sequence
        sends = self._stamp_sends
        for send in sends:  # one call per request: Testall and Startall build an array of them each time
            if not send.Test():
                self._send_from_own_buffer(sequence, signature)
                return
        stamp = self._stamp  # 16-byte sends complete at once: the stamp is free again
        stamp[0], stamp[1] = sequence, signature
        for send in sends:
            send.Start()

    def _send_from_own_buffer(self, announced: int, signature: int = 0) -> None:
        """Sends `announced` (and its signature) to every peer by message from a buffer of its own: an
        announcement while the stamp's sends are still in flight, or the marker of `leave`."""
        MPI = self.group.MPI
        if len(self._sends) >= _CHECK_SENDS_EVERY and MPI.Request.Testall(self._sends):  # rare: look seldom
            self._sends.clear()
            self._stamps.clear()
        stamp = array.array("q", [announced, signature])  # a buffer of its own; MPI keeps messages to a peer in order
        self._stamps.append(stamp)
        for peer in self._peers:
            self._sends.append(self._board.Isend([stamp, MPI.INT64_T], dest=peer, tag=_TAG))

    def _missing(self, sequence: int | None = None) -> tuple[int, ...]:
        """Collects the announcements that arrived (up to `sequence`, default the last announced); returns the
        peers still missing."""
        sequence = self.sequence if sequence is None else sequence
        missing = tuple(peer for peer, slot in zip(self._near, self._near_slots)
                        if _last_announced(slot[0]) < sequence)
        for k, receive in enumerate(self._receives):
            while _last_announced(self._seen[k]) < sequence:
                if self._seen[k] < 0 or not receive.Test():  # left, or not there yet
                    missing += (self._peers[k],)
                    break
                # peers announce 1, 2, 3, ... in order, then maybe leave: this stops at the number waited for, and
                # keeps its signature (the receive, started again, may overwrite the inbox at once)
                self._seen[k], self._signatures[k] = self._inboxes[k]
                if self._seen[k] >= 0:
                    receive.Start()
        return tuple(sorted(missing)) if self._near_slots and self._peers else missing

    def _wait_for_peers(self, what: str, timeout: float | None, sequence: int | None = None) -> None:
        """Returns once every peer has announced collective `sequence` (default: the last announced)."""
        sequence = self.sequence if sequence is None else sequence
        for _ in self._quick_polls:
            if not self._missing(sequence):
                return
        begin = time.monotonic()
        limit = timeout if timeout is not None else default_timeout()
        while True:
            missing = self._missing(sequence)
            if not missing:
                return
            waited = time.monotonic() - begin
            if waited > LEFT_CHECK_SECONDS:  # not on every poll: a peer in step comes soon
                left = self.left_error(what, sequence, missing)
                if left is not None:
                    self.group.broken = left
                    raise left
            if waited > limit:
                self.group.broken = missing_error(self, what, limit, sequence, missing)
                raise self.group.broken
            if waited > SPIN_SECONDS:
                time.sleep(NAP_SECONDS)
            elif self._yield:
                os.sched_yield()  # the peer we wait for may need this core

    def left_error(self, what: str, sequence: int, missing: tuple[int, ...]) -> WorkerFailedError | None:
        """The error of collective #`sequence`, which the peers of `missing` whose program has ended (`leave`) will
        never reach; None while none of them has, as far as this rank has seen."""
        group = self.group
        left = [(peer, announced) for peer, announced in self._announced() if peer in missing and announced < 0]
        if not left:
            return None
        ranks = tuple(peer for peer, _ in left)
        gone = "; ".join(f"{group.describe((peer,))} left the job after collective #{_last_announced(marker)}"
                         for peer, marker in left)
        return WorkerFailedError(
            f"{what} across processes cannot complete: {gone} (its program ended: sys.exit, or the end of its "
            f"script), and this rank is at collective #{sequence} of the job's {self.name}. Every rank must make "
            f"the same collectives; a rank that ends early stops the job. {RESTART}", ranks=ranks)

    def __repr__(self) -> str:
        return f"<Channel {self.name!r} rank={self.group.rank} announced={self.sequence}>"



def missing_error(channel: Channel, what: str, limit: float, sequence: int, missing: tuple[int, ...],
                  detail: str = "") -> DeadlineExceededError:
    """The error of collective #`sequence` that the `missing` ranks never reached within `limit` seconds."""
    group = channel.group
    return DeadlineExceededError(
        f"{what} across processes timed out after {limit:g} s: {group.describe(missing)} never reached it "
        f"(collective #{sequence} of the job's {channel.name}).{detail} A rank that stalls, crashes or skips a "
        f"collective stops the job; raise CommunicationOptions(timeout_seconds=...) if the work is just slow. "
        f"Restart the job; `--resume` continues from the last checkpoint.",
        operation=what, missing_ranks=missing, missing_replicas=group.replicas_of(missing))


def _left_after(sequence: int) -> int:
    """What a rank announces as it leaves after collective `sequence`: a negative number, below every collective's
    (so the waits see it missing at once), from which `_last_announced` reads `sequence` back."""
    return -sequence - 1


def _last_announced(announced: int) -> int:
    """The last collective a peer announced, from what it announced last (a number, or `_left_after`'s marker)."""
    return announced if announced >= 0 else -announced - 1


def _shared_slots(MPI: Any, comm: Any, wanted: bool) -> dict[int, memoryview]:
    """{rank of `comm`: its announcement slot} for the ranks on this host, each three 8-byte integers starting at 0
    in a file they all map (in /dev/shm where there is one); {} where this rank is alone on its host, the file
    cannot be shared, or a rank on this host does not want slots (then every peer gets messages): the ranks of a
    host agree. Collective over `comm`, whatever `wanted` is.

    A mapped file rather than an MPI shared-memory window: creating a window makes some Open MPI 5 builds print
    errors from RMA components that do not apply (osc/ucx without UCX hardware), and only the memory is needed.
    The file is removed as soon as every rank has mapped it, so nothing is left behind, even by a killed job.

    A slot holds the number of the collective its rank announced last, then the signatures of its last odd and
    last even collective, each beside the low 16 bits of that collective's number: a peer still comparing
    collective n reads n's signature even after this rank has moved on to n + 1 (it may: where every rank raised
    CollectiveMismatchError, or after the root's broadcast). Only n + 2 overwrites it, which the number tells;
    no rank that waits at its collectives announces n + 2 before every peer has announced n + 1 (launches
    with a lead, `announce`, may).
    """
    host = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        size = host.Get_size()
        if size == 1:
            return {}
        path = host.bcast(_new_board(size * _SLOT_BYTES) if host.Get_rank() == 0 and wanted else None, root=0)
        board = None
        if path is not None and wanted:
            try:
                with open(path, "r+b") as file:
                    board = mmap.mmap(file.fileno(), size * _SLOT_BYTES)
            except OSError:
                pass
        everywhere = host.allreduce(board is not None, op=MPI.LAND)
        if path is not None and host.Get_rank() == 0:
            os.unlink(path)
        if not everywhere:
            return {}
        ranks = host.Get_group().Translate_ranks(list(range(size)), comm.Get_group())
        memory = memoryview(board)  # keeps the mapping for the life of the process
        return {rank: memory[k * _SLOT_BYTES:k * _SLOT_BYTES + 24].cast("q") for k, rank in enumerate(ranks)}
    finally:
        host.Free()


def _new_board(size: int) -> str | None:
    """The path of a new zero-filled file of `size` bytes for this host's slots, or None where none can be made."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()  # /dev/shm: never on disk
    try:
        descriptor, path = tempfile.mkstemp(prefix="distrib-announcements-", dir=directory)
    except OSError:
        return None
    try:
        os.ftruncate(descriptor, size)
    except OSError:
        os.unlink(path)
        return None
    finally:
        os.close(descriptor)
    return path
