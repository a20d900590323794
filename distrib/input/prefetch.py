"""Background prefetch: a daemon thread that prepares the next steps while the training step runs."""

from __future__ import annotations

import _thread
import atexit
import collections
import threading
import time
import weakref
from typing import Any, Callable

from distrib import context

END = object()


class _Signal:
    """A wake-up call between two threads: `wait` returns once `notify` was called since the last wait."""

    def __init__(self):
        self._lock = _thread.allocate_lock()
        self._lock.acquire()

    def notify(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:  # already notified and not yet consumed
            pass

    def wait(self, timeout: float) -> None:
        self._lock.acquire(timeout=timeout)


class Prefetcher:
    """Prepares up to `depth` steps ahead in a daemon thread while the consumer is busy; exceptions keep order.

    Handing a step from one thread to the other costs GIL handoffs (~20 us on two cores), which only pays when
    the consumer spends longer than that away between steps (a training step). So steps are produced inline
    until the consumer's measured time away per step exceeds `AHEAD_AFTER_SECONDS`; from then on a thread
    runs ahead. The choice is remembered in `pace` (shared by a dataset's epochs). Both sides work in bursts of
    half the buffer to wake each other rarely. The thread holds no reference to the iterator that owns it, so
    dropping the iterator stops the thread. `finish`, if given, turns each produced item into the step on the
    consumer's thread, when the step is asked for (StopIteration from it ends the iteration).

    The thread runs in the context (strategy scope) of the thread that created the prefetcher, as the steps
    produced inline do. A new epoch of the same dataset first stops the threads of earlier epochs'
    iterators (`stop_reading_ahead`), which may be inside the source's `__next__` still: a source that starts
    over in `__iter__` would otherwise hand its first batch to the old iterator. `read_ahead=False` (TensorFlow's
    `experimental_per_replica_buffer_size=0`) never starts the thread.
    """

    AHEAD_AFTER_SECONDS = 30e-6

    def __init__(self, produce: Callable[[], Any], depth: int, pace: dict,
                 finish: Callable[[Any], Any] | None = None, read_ahead: bool = True):
        self._produce, self._depth, self._pace, self._finish = produce, depth, pace, finish
        self._half = max(1, depth // 2)
        self._items: collections.deque = collections.deque()
        self._filled, self._drained = _Signal(), _Signal()
        # "inline": the thread was stopped for a newer iterator of the same source; steps are produced inline
        self._state = {"waiting": False, "stopped": False, "inline": not read_ahead}
        self._thread: threading.Thread | None = None
        self._returned_at: float | None = None
        self._done = False
        self._context = list(context.thread_stack())
        if pace.get("ahead") and read_ahead:
            self._start_thread()

    def _start_thread(self) -> None:
        self._pace["ahead"] = True
        self._thread = threading.Thread(
            target=self._fill, args=(self._produce, self._depth, self._half, self._items, self._filled,
                                     self._drained, self._state, self._context),
            daemon=True, name="distrib-input-prefetch")
        readers = self._pace.setdefault("readers", [])
        readers[:] = [reader for reader in readers if reader[0].is_alive()]
        readers.append((self._thread, self._state, self._drained))
        self._thread.start()
        _LIVE.add(self)

    @staticmethod
    def _fill(produce, depth, half, items, filled, drained, state, stack) -> None:
        context.set_stack(stack)
        while not state["stopped"]:
            if len(items) >= depth:
                filled.notify()
                while len(items) > half and not state["stopped"]:
                    drained.wait(timeout=0.1)
                continue
            item = _produce_one(produce)
            items.append(item)
            final = item is END or isinstance(item, BaseException)
            if final or (state["waiting"] and len(items) >= half):
                filled.notify()
            if final:
                return

    def get(self) -> Any:
        if self._done:
            raise StopIteration
        if self._thread is None and not self._items:
            if self._returned_at is not None and not self._state["inline"] and \
                    self._consumer_is_busy(time.perf_counter() - self._returned_at):
                self._start_thread()
            item = _produce_one(self._produce) if self._thread is None else self._pop()
        else:
            item = self._pop()
        if item is END or isinstance(item, BaseException):
            self.close()
            if item is not END:
                raise item
            raise StopIteration
        if self._finish is not None:
            try:
                item = self._finish(item)
            except BaseException:
                self.close()
                raise
        if self._thread is None:
            self._returned_at = time.perf_counter()
        return item

    def _consumer_is_busy(self, away: float) -> bool:
        """Whether the consumer's time away per step (median of the first 8, then a moving average) is long."""
        samples = self._pace.setdefault("samples", [])
        if len(samples) < 8:  # a median, so that one garbage collection does not decide
            samples.append(away)
            if len(samples) < 8:
                return False
            self._pace["away"] = sorted(samples)[4]
        else:  # each step's weight capped: one pause (a garbage collection, the core taken by another process for a
            # millisecond) must not start the thread for good; a consumer that is busy every step still does in ~6
            self._pace["away"] = 0.95 * self._pace["away"] + 0.05 * min(away, 4 * self.AHEAD_AFTER_SECONDS)
        return self._pace["away"] > self.AHEAD_AFTER_SECONDS

    def _pop(self) -> Any:
        while True:
            try:
                item = self._items.popleft()
            except IndexError:
                if self._state["inline"]:  # the thread was stopped and joined: on from here without it
                    self._thread = None
                    return _produce_one(self._produce)
                self._state["waiting"] = True
                self._filled.wait(timeout=0.05)
                self._state["waiting"] = False
                continue
            if len(self._items) <= self._half:
                self._drained.notify()
            return item

    def close(self) -> None:
        """Ends the iteration: the thread, if any, stops and later calls raise StopIteration."""
        self._done = True
        self._state["stopped"] = True
        self._drained.notify()


def stop_reading_ahead(pace: dict) -> None:
    """Stops the prefetch threads started with `pace` (a dataset's earlier iterators) and waits until each has
    left the source; their iterators, if still used, go on producing their steps inline."""
    for thread, state, drained in pace.pop("readers", ()):
        if thread is threading.current_thread():  # a source that iterates its own dataset: nothing to wait for
            continue
        state["stopped"] = True
        drained.notify()
        thread.join()
        state["inline"] = True  # only once the thread is out: the consumer then reads the source itself


_LIVE: "weakref.WeakSet[Prefetcher]" = weakref.WeakSet()


@atexit.register
def _stop_prefetch_threads() -> None:
    """Stops running prefetch threads before the interpreter finalizes: a daemon thread still inside NumPy or
    optree when the interpreter tears down aborts the process."""
    prefetchers = list(_LIVE)
    for prefetcher in prefetchers:
        prefetcher.close()
    for prefetcher in prefetchers:
        if prefetcher._thread is not None:
            prefetcher._thread.join(timeout=2.0)


def _produce_one(produce: Callable[[], Any]) -> Any:
    """One step, or END, or the exception producing it raised (delivered in order)."""
    try:
        return produce()
    except StopIteration:
        return END
    except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer, at the step it belongs to
        return exc
