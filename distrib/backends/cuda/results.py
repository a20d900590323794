"""Output buffers of packed all-reduces and their members' views, reused from step to step while nobody holds them.

A step of a training loop all-reduces the same plan every time. Building a CuPy view costs 1-3 us of Python, so
4 replicas unpacking 200 members each spent more on views than on the sums. The output flat of each (buffer,
replica) and its member views are therefore kept and handed out again, as long as no reference to the flat, its
memory, any of its views or their memory pointers is left from the previous step: reference counts, measured when
the views were made, say so exactly, as the CPU emulator's buffer pool does. A caller that keeps a result gets
fresh buffers next time; nothing it holds is ever overwritten.

As on the CPU emulator, members of at most SMALL_MEMBER_BYTES of a pack of at least MIN_PACK_BYTES are handed out
as copies (losses, metrics, counts), so a kept small result holds only itself, not its whole pack, and leaves the
pack reusable; larger members are views of the flat.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

from distrib.backends.cpu import SMALL_MEMBER_BYTES, BufferPool
from distrib.plan import Buffer

MIN_PACK_BYTES = BufferPool.MIN_BYTES  # a smaller pack pinned by a kept member costs little: nothing is copied
MAX_ENTRIES = 512  # (buffer, replica) pairs remembered; plans beyond that are rare and just allocate


def member_views(flat: Any, buffer: Buffer) -> list:
    """Views of `flat`, one per member of `buffer`, in the members' shapes."""
    return [flat[span] if shape is None else flat[span].reshape(shape) for span, shape in buffer.views]


def copied_members(buffer: Buffer, itemsize: int) -> list[int]:
    """Which members are handed out as copies: those of at most SMALL_MEMBER_BYTES, in a pack of several members
    and at least MIN_PACK_BYTES (keeping one then does not keep the whole flat)."""
    if len(buffer.members) < 2 or buffer.size * itemsize < MIN_PACK_BYTES:
        return []
    return [k for k, member in enumerate(buffer.members) if member.size * itemsize <= SMALL_MEMBER_BYTES]


def hand_out(views: list, copied: list[int]) -> list:
    """`views` with the members at positions `copied` copied, on the current device and stream."""
    members = list(views)
    for k in copied:
        members[k] = members[k].copy()
    return members


class Output:
    """One replica's output flat of one buffer, its members' views, and the reference counts of an idle one."""

    def __init__(self, buffer: Buffer, flat: Any):
        self.buffer, self.flat = buffer, flat
        self.views = member_views(flat, buffer)
        self.copied = copied_members(buffer, flat.itemsize)
        self._idle: tuple | None = None

    def settle(self) -> None:
        """Records the reference counts as they are now: call it once nothing but this object holds the flat."""
        self._idle = self._counts()

    def _counts(self) -> tuple:
        return (sys.getrefcount(self.flat), sys.getrefcount(self.flat.data.mem),
                [sys.getrefcount(v) for v in self.views], [sys.getrefcount(v.data) for v in self.views])

    def idle(self) -> bool:
        """Whether nothing but this object references the flat, its memory, its views or their memory pointers."""
        return self._counts() == self._idle


class Outputs:
    """Output flats per (buffer, replica position), reused while idle (see the module docstring). Thread-safe."""

    def __init__(self):
        self._entries: dict[tuple[int, int], Output] = {}
        self._by_flat: dict[int, Output] = {}
        self._lock = threading.Lock()

    def take(self, buffer: Buffer, position: int, allocate: Callable[[], Any]) -> Any:
        """The output flat for replica `position` of `buffer`: last step's if idle, else `allocate()`'s."""
        key = (id(buffer), position)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.buffer is buffer and entry.idle():
                return entry.flat
            if entry is not None:
                del self._by_flat[id(entry.flat)]
            if len(self._entries) >= MAX_ENTRIES:
                self._entries.clear()
                self._by_flat.clear()
            entry = Output(buffer, allocate())  # the new flat is referenced by the entry alone once this returns
            entry.settle()
            self._entries[key] = entry
            self._by_flat[id(entry.flat)] = entry
            return entry.flat

    def members(self, flat: Any, buffer: Buffer) -> list:
        """`flat`'s members for the caller (see `hand_out`): of the kept views if `flat` came from `take`."""
        entry = self._by_flat.get(id(flat))
        if entry is not None and entry.flat is flat and entry.buffer is buffer:
            return hand_out(entry.views, entry.copied)
        return hand_out(member_views(flat, buffer), copied_members(buffer, flat.itemsize))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._by_flat.clear()
