"""Host-to-device input copies: pinned staging buffers reused across steps, filled in parallel, copied in chunks.

A pageable NumPy batch cannot be copied to the GPU at full speed: the bytes must first pass through pinned (page-
locked) host memory. Allocating pinned memory costs milliseconds per 64 MiB and one thread fills it at a fraction
of the memory bus, so a batch is staged into a pinned buffer kept from earlier steps, in chunks filled by a small
thread pool (NumPy's copies release the GIL), and each chunk's asynchronous copy to the device is queued as soon as
it is staged, so the DMA engine works while the next chunks are being filled.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import os
import threading
from typing import Any

import cupy
import numpy as np

CHUNK_BYTES = 8 << 20  # staged and copied in chunks this large: copying chunk k overlaps filling chunk k + 1
STAGING_THREADS = max(1, min(8, (os.cpu_count() or 1) // 2))
MAX_FREE_PER_SIZE = 4  # pinned buffers kept per byte size once their copies are done


class PinnedPool:
    """Pinned host buffers by byte size, handed out again once the copies that read them have completed."""

    def __init__(self):
        self._free: dict[int, list[Any]] = collections.defaultdict(list)
        self._busy: collections.deque[tuple[Any, list[tuple[int, Any]]]] = collections.deque()  # in copy order
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Any:
        """A pinned buffer of `nbytes` that no pending copy reads."""
        with self._lock:
            self._reclaim()
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        return cupy.cuda.alloc_pinned_memory(nbytes)

    def release_after(self, event: Any, buffers: list[tuple[int, Any]]) -> None:
        """Returns `buffers`, (nbytes asked for, buffer) pairs, to the pool once `event` (recorded after the copies
        reading them) has completed."""
        with self._lock:
            self._busy.append((event, buffers))

    def _reclaim(self) -> None:
        while self._busy and self._busy[0][0].done:
            _, buffers = self._busy.popleft()
            for nbytes, memory in buffers:
                free = self._free[nbytes]
                if len(free) < MAX_FREE_PER_SIZE:
                    free.append(memory)


class Stager:
    """Copies host arrays into device arrays on a stream through pooled pinned memory (see the module docstring)."""

    def __init__(self):
        self.pool = PinnedPool()
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:  # replica threads prefetch at once: one pool of threads for all of them
            if self._threads is None:
                self._threads = concurrent.futures.ThreadPoolExecutor(STAGING_THREADS,
                                                                      thread_name_prefix="distrib-stage")
            return self._threads

    def upload(self, host: np.ndarray, out: cupy.ndarray, stream: Any) -> tuple[int, Any]:
        """Queues the copy of C-contiguous `host` into `out` (same bytes) on `stream`; returns (nbytes, the pinned
        buffer), which the caller hands to `pool.release_after` with an event recorded after the copy."""
        nbytes = host.nbytes
        memory = self.pool.take(nbytes)
        pinned = np.frombuffer(memory, np.uint8, nbytes)
        source = host.reshape(-1).view(np.uint8)
        chunks = [(start, min(CHUNK_BYTES, nbytes - start)) for start in range(0, nbytes, CHUNK_BYTES)]

        def stage(start: int, size: int) -> None:
            np.copyto(pinned[start:start + size], source[start:start + size])

        staged: list[concurrent.futures.Future] = []
        try:
            if len(chunks) == 1 or STAGING_THREADS == 1:
                for start, size in chunks:
                    stage(start, size)
                    (out.data + start).copy_from_host_async(ctypes.c_void_p(memory.ptr + start), size, stream)
                return nbytes, memory
            staged = [self._executor().submit(stage, start, size) for start, size in chunks]
            for (start, size), done in zip(chunks, staged):
                done.result()  # in order: chunk k is queued while later chunks are still being filled
                (out.data + start).copy_from_host_async(ctypes.c_void_p(memory.ptr + start), size, stream)
            return nbytes, memory
        except BaseException:  # chunks already queued still read the buffer: it returns once they are done, and
            # once no staging thread writes into it any more (it could be handed out again meanwhile)
            for later in staged:
                later.cancel()
            concurrent.futures.wait(staged)
            self.pool.release_after(stream.record(cupy.cuda.Event(disable_timing=True)), [(nbytes, memory)])
            raise
