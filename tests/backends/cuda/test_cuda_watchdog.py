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


class Communicator:
    """Stands for an NCCL communicator: records when it is aborted."""

    def __init__(self, log: list):
        self.log = log

    def abort(self):
        self.log.append("aborted")


def test_an_abort_from_the_watchdog_waits_for_a_launch_in_progress_to_leave_nccl():
    nccl = pytest.importorskip("distrib.backends.cuda.nccl", reason="needs CuPy's NCCL bindings")
    communicators, log = nccl.Communicators(), []
    comms = [Communicator(log), Communicator(log)]
    communicators._groups[(0, 1)] = comms
    with communicators._launch_lock:  # another thread is launching on these communicators
        aborting = threading.Thread(target=communicators._abort, args=((0, 1), comms))
        aborting.start()
        aborting.join(0.2)
        log.append("launched")
    aborting.join(5)
    assert log == ["launched", "aborted", "aborted"]
    assert (0, 1) not in communicators._groups  # the next collective creates new ones


def test_a_launch_hung_inside_nccl_is_aborted_all_the_same(monkeypatch):
    nccl = pytest.importorskip("distrib.backends.cuda.nccl", reason="needs CuPy's NCCL bindings")
    monkeypatch.setattr(nccl, "ABORT_LOCK_SECONDS", 0.05)
    communicators, log = nccl.Communicators(), []
    held = threading.Event()
    release = threading.Event()

    def hung_launch():
        with communicators._launch_lock:
            held.set()
            release.wait(10)

    launcher = threading.Thread(target=hung_launch)
    launcher.start()
    held.wait(5)
    communicators._abort((0,), [Communicator(log)])  # NCCL's way out of a hang: abort from another thread
    release.set()
    launcher.join(5)
    assert log == ["aborted"]
