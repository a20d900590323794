"""Output buffers of packed all-reduces and their members' views, reused from step to step while nobody holds them.

A step of a training loop all-reduces the same plan every time. Building a CuPy view costs 1-3 us of Python, so
4 replicas unpacking 200 members each spent more on views than on the sums. The output flat of each (buffer,
replica) and its member views are therefore kept and handed out again, as long as no reference to the flat, its
memory, any of its views or their memory pointers is left from the previous step: reference counts, measured when
the views were made, say so exactly, as the CPU emulator's buffer pool does. A caller that keeps a result gets
fresh buffers next time; nothing it holds is ever overwritten.

As on the CPU emulator, a kept result keeps only itself alive: the member of a pack of one is a view of the whole
flat, and the members of a pack of several are arrays of their own, which the unpack kernel fills from the flat;
those are reused too, each while nobody holds it, so the flat is always free again after its step.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

from distrib.backends.packed import member_views
from distrib.plan import Buffer

Empty = Callable[[Any, Any], Any]  # (shape, dtype) -> a new array on the current device
MAX_ENTRIES = 512  # (buffer, replica, GPU) outputs remembered; plans beyond that are rare and just allocate


def _counts(array: Any) -> tuple:
    """The reference counts of an array, its memory pointer and its memory (a DLPack consumer holds the pointer)."""
    return sys.getrefcount(array), sys.getrefcount(array.data), sys.getrefcount(array.data.mem)


class Copies:
    """The arrays of their own that the members of a pack of several are unpacked into, each reused while idle."""

    def __init__(self, buffer: Buffer):
        self.buffer = buffer
        self.arrays: list[Any] = [None] * len(buffer.members)
        self._idle: list[tuple | None] = [None] * len(buffer.members)
        self.unpack: Callable[[], None] | None = None  # the unpack launch into `arrays`, while none is replaced

    def take(self, dtype: Any, empty: Empty) -> list:
        """One array per member: last time's where nobody holds it any more, else a new one from `empty`."""
        arrays, idle = self.arrays, self._idle
        for k in range(len(arrays)):  # counted with no loop variable holding the array, as when settled
            if arrays[k] is None or _counts(arrays[k]) != idle[k]:
                arrays[k] = empty(self.buffer.members[k].shape, dtype)
                idle[k] = _counts(arrays[k])
                self.unpack = None
        return list(arrays)


class Output:
    """One replica's output flat of one buffer, its members' views, and the reference counts of an idle one."""

    def __init__(self, buffer: Buffer, flat: Any):
        self.buffer, self.flat = buffer, flat
        self.views = member_views(flat, buffer) if len(buffer.members) == 1 else []
        self.copies = Copies(buffer) if len(buffer.members) > 1 else None
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
    """Output flats per (buffer, replica position, GPU), reused while idle (see the module docstring). Thread-safe."""

    def __init__(self):
        self._entries: dict[tuple[int, int, int], Output] = {}
        self._by_flat: dict[int, Output] = {}
        self._lock = threading.Lock()

    def take(self, buffer: Buffer, position: int, ordinal: int, allocate: Callable[[], Any]) -> Any:
        """The output flat for replica `position` (on GPU `ordinal`) of `buffer`: last step's if idle, else
        `allocate()`'s. A plan shared by strategies on other devices gets outputs of its own per device."""
        key = (id(buffer), position, ordinal)
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

    def members(self, flat: Any, buffer: Buffer, empty: Empty) -> list:
        """`flat`'s members for the caller: the view of a pack of one, else arrays of their own (from `empty`,
        on the current device) for the unpack kernel to fill; those of last step if `flat` came from `take`."""
        entry = self._by_flat.get(id(flat))
        if entry is None or entry.flat is not flat or entry.buffer is not buffer:
            return member_views(flat, buffer) if len(buffer.members) == 1 else \
                [empty(member.shape, flat.dtype) for member in buffer.members]
        return list(entry.views) if entry.copies is None else entry.copies.take(flat.dtype, empty)

    def unpacking(self, flat: Any, buffer: Buffer, empty: Empty,
                  prepare: Callable[[list], Callable[[], None] | None]) -> tuple[list, Callable[[], None] | None]:
        """The members of a pack of several (as `members`) and the unpack launch into them, `prepare(members)`: kept
        with reused arrays, so that a step that reuses every one launches without rebuilding its table."""
        entry = self._by_flat.get(id(flat))
        if entry is None or entry.flat is not flat or entry.buffer is not buffer or entry.copies is None:
            members = self.members(flat, buffer, empty)
            return members, prepare(members)
        copies = entry.copies
        members = copies.take(flat.dtype, empty)
        if copies.unpack is None:
            copies.unpack = prepare(members)
        return members, copies.unpack

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._by_flat.clear()
