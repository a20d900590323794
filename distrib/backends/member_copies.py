"""The emulator's copies of a reduced pack's members, reused from step to step while nobody holds them.

A member handed out as a view of its pack would keep the whole pack alive, so the members of a pack of several
are copied out of it. Fresh copies every step cost more than the copying itself: small arrays freed at the end
of a step give their pages back to the OS and fault them in again at the next (130 faults per step for 200
members of 4 KB). So each buffer keeps its members' copies, and the read-only views of them that the emulated
devices get, and refills them the next time, member by member, as long as nothing references the copy or its
views any more: reference counts, measured when they were made, say so exactly (as BufferPool's do).
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Callable, Sequence

import numpy as np

from distrib.plan import Buffer

MAX_BUFFERS = 512  # buffers remembered; plans beyond that are rare and just make new copies
MAX_BYTES = 1 << 30  # and at most this much memory of copies nobody holds (as BufferPool bounds its bases)


class _Members:
    """One buffer's member copies (writable, private) and each device's read-only views of them.

    A copy and its views are idle when the sum of their reference counts is what it was when they were made:
    counts never fall below that, since this object holds them. A view of a view, or the copy itself taken
    from a view's `base`, counts on the copy.
    """

    def __init__(self, buffer: Buffer, dtype: np.dtype, count: int):
        self.buffer = buffer
        self.spans = [member.span for member in buffer.members]
        self.byte_spans = [(span.start * dtype.itemsize, span.stop * dtype.itemsize) for span in self.spans]
        self.copies = [np.empty(member.shape, dtype) for member in buffer.members]
        self.flat_copies = [copy.reshape(-1) for copy in self.copies]  # what the pack's slices are copied into
        self.byte_copies = [_bytes(copy) for copy in self.flat_copies]
        self.by_device = [[_read_only_view(copy) for copy in self.copies] for _ in range(count)]
        self.idle = [self._member_count(k) for k in range(len(self.copies))]
        self.idle_total = self._total()

    def _member_count(self, k: int) -> int:
        return sys.getrefcount(self.copies[k]) + sum(sys.getrefcount(views[k]) for views in self.by_device)

    def _total(self) -> int:
        return sum(map(sys.getrefcount, self.copies)) + sum(sum(map(sys.getrefcount, views))
                                                            for views in self.by_device)

    def take(self) -> None:
        """Replaces each member whose copy or views somebody still holds (all idle: one cheap check)."""
        if self._total() == self.idle_total:
            return
        for k, member in enumerate(self.buffer.members):
            if self._member_count(k) != self.idle[k]:
                self.copies[k] = np.empty(member.shape, self.copies[k].dtype)
                self.flat_copies[k] = self.copies[k].reshape(-1)
                self.byte_copies[k] = _bytes(self.flat_copies[k])
                for views in self.by_device:
                    views[k] = _read_only_view(self.copies[k])
                self.idle[k] = self._member_count(k)
        self.idle_total = self._total()


def _bytes(flat: np.ndarray) -> memoryview:
    """The bytes of a contiguous 1-D array: copying slices of these costs half of NumPy's per-call overhead."""
    return memoryview(flat.view(np.uint8))


def _read_only_view(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


class MemberCopies:
    """Hands out the members of read-only packs as read-only arrays of their own, one per device (thread-safe)."""

    def __init__(self):
        self._entries: dict[tuple[int, int], _Members] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<MemberCopies buffers={len(self._entries)}>"

    def unpack(self, flat: np.ndarray, buffer: Buffer, count: int,
               run_split: Callable[[Sequence[Callable[[], None]], int], None], on_threads: bool) -> list[list]:
        """`count` lists of `buffer`'s members in `flat`: copies of their own, the lists distinct arrays of one
        copy per member. Copies run through `run_split` (spread over threads when `on_threads`)."""
        with self._lock:
            entry = self._entries.get((id(buffer), count))
            if entry is None or entry.buffer is not buffer:
                if len(self._entries) >= MAX_BUFFERS or self._bytes + flat.nbytes > MAX_BYTES:
                    self._entries.clear()
                    self._bytes = 0
                entry = self._entries[(id(buffer), count)] = _Members(buffer, flat.dtype, count)
                self._bytes += flat.nbytes
            else:
                entry.take()
            if on_threads:  # the jobs name the entry, not the copies: a thread may hold its last job a while
                run_split([functools.partial(_copy_member, entry, flat, k) for k in range(len(entry.spans))],
                          flat.nbytes)
            elif flat.flags.c_contiguous:
                source = _bytes(flat)
                for copy, (start, stop) in zip(entry.byte_copies, entry.byte_spans):
                    copy[:] = source[start:stop]
            else:
                for copy, span in zip(entry.flat_copies, entry.spans):
                    copy[...] = flat[span]
            return [list(views) for views in entry.by_device]


def _copy_member(entry: _Members, flat: np.ndarray, k: int) -> None:
    entry.flat_copies[k][...] = flat[entry.spans[k]]
