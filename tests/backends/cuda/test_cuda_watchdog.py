"""The watchdog of asynchronous collectives: the caller returns at once; deadlines and errors abort and surface once."""

from __future__ import annotations

import threading
import time

import pytest

from distrib.backends.cuda.watchdog import Watchdog, Watched


class Event:
    """Stands for a CUDA event: `done` once the test says the device work has finished."""

    def __init__(self, done: bool = False):
        self.done = done


def watched(events, *, deadline_s=60.0, error=None, aborted=None, operation="all_reduce"):
    def poll_errors():
        if error is not None:
            raise error

    return Watched(operation, events, time.monotonic() + deadline_s, poll_errors,
                   (aborted.set if aborted is not None else (lambda: None)),
                   lambda: TimeoutError(f"{operation} did not complete within {deadline_s:g} s"))


def test_watch_returns_before_the_work_completes_and_wait_blocks_until_it_has():
    dog = Watchdog()
    event = Event()
    dog.watch(watched([event, Event(done=True)]))
    assert dog.pending() == 1
    threading.Timer(0.05, lambda: setattr(event, "done", True)).start()
    dog.wait()
    assert dog.pending() == 0


def test_the_thread_retires_completed_collectives_without_a_waiting_caller():
    dog = Watchdog()
    event = Event()
    dog.watch(watched([event]))
    event.done = True
    for _ in range(500):
        if not dog.pending():
            break
        time.sleep(0.01)
    assert dog.pending() == 0


def test_a_collective_past_its_deadline_is_aborted_and_its_error_raised_once_at_the_next_sync():
    dog = Watchdog()
    aborted = threading.Event()
    dog.watch(watched([Event()], deadline_s=0.05, aborted=aborted))
    with pytest.raises(TimeoutError, match=r"^all_reduce did not complete within 0\.05 s"):
        dog.wait()
    assert aborted.is_set() and dog.pending() == 0
    dog.check()  # raised once: the strategy stays usable
    dog.watch(watched([Event(done=True)]))
    dog.wait()


def test_the_thread_aborts_at_the_deadline_even_when_nobody_waits():
    dog = Watchdog()
    aborted = threading.Event()
    dog.watch(watched([Event()], deadline_s=0.02, aborted=aborted))
    assert aborted.wait(5), "the watchdog thread never aborted the late collective"
    with pytest.raises(TimeoutError):
        dog.check()


def test_an_asynchronous_error_aborts_and_surfaces_as_the_librarys_error():
    dog = Watchdog()
    aborted = threading.Event()
    dog.watch(watched([Event()], error=RuntimeError("NCCL reported an unhandled system error"), aborted=aborted))
    with pytest.raises(RuntimeError, match="^NCCL reported"):
        dog.wait()
    assert aborted.is_set()


def test_the_first_failure_is_the_one_raised():
    dog = Watchdog()
    dog.watch(watched([Event()], deadline_s=0.0, operation="all_gather"))
    dog.watch(watched([Event()], deadline_s=0.0, operation="broadcast"))
    with pytest.raises(TimeoutError, match="^all_gather"):
        dog.wait()
    dog.check()


class Failing:
    """Stands for a CUDA event whose query raises, as every CUDA call does after a sticky error."""

    @property
    def done(self):
        raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")


def test_an_event_that_cannot_be_queried_fails_its_collective_and_the_thread_carries_on():
    dog = Watchdog()
    aborted = threading.Event()
    dog.watch(watched([Failing()], aborted=aborted))
    assert aborted.wait(5), "the watchdog thread never failed the collective"
    with pytest.raises(RuntimeError, match="^cudaErrorIllegalAddress"):
        dog.check()
    dog.watch(watched([Event(done=True)]))
    for _ in range(500):
        if not dog.pending():
            break
        time.sleep(0.01)
    assert dog.pending() == 0  # the thread is still polling


def test_settle_raises_a_failure_whose_abort_is_still_in_progress():
    # the host has seen the stream finish (an abort ends the collective's kernels) before the watchdog's thread has
    # kept the error: settle waits for that pass instead of reporting success
    dog = Watchdog()
    event, aborting = Event(), threading.Event()

    def slow_abort():
        aborting.set()
        event.done = True  # the aborted kernels return
        time.sleep(0.2)

    dog.watch(Watched("all_reduce", [event], time.monotonic() + 0.01, lambda: None, slow_abort,
                      lambda: TimeoutError("all_reduce did not complete within 0.01 s")))
    assert aborting.wait(5)
    with pytest.raises(TimeoutError, match="^all_reduce did not complete"):
        dog.settle()


def test_a_forgotten_collective_is_no_longer_watched():
    dog = Watchdog()
    pending = watched([Event()])
    dog.watch(pending)
    assert dog.forget(pending) is True and dog.pending() == 0
    assert dog.forget(pending) is False
    dog.wait()
