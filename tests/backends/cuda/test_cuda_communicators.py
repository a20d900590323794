"""NCCL communicators without a GPU: a hung launch ends at its deadline, and nothing touches a communicator once aborted.

NCCL's own group calls run here (they need no GPU); the communicators, devices, streams and events are stand-ins
that record every call, so the order of launches, polls and aborts across the caller's and the watchdog's threads
can be checked.
"""

from __future__ import annotations

import threading
import time

import pytest

cupy = pytest.importorskip("cupy", reason="CuPy comes with distrib[test]")
from cupy.cuda import nccl  # noqa: E402

from distrib.backends.cuda import nccl as nccl_comms  # noqa: E402
from distrib.backends.cuda.nccl import Clique, Communicators  # noqa: E402
from distrib.errors import CollectiveError, DeadlineExceededError  # noqa: E402

pytestmark = pytest.mark.skipif(not nccl.available, reason="NCCL is not loadable (nvidia-nccl-cu12 is in distrib[test])")


class Comm:
    """Stands for an NcclCommunicator: records its calls, and fails any call made after its abort."""

    def __init__(self, log: list):
        self.log, self.aborted = log, threading.Event()

    def call(self, name: str) -> None:
        if self.aborted.is_set():
            raise AssertionError(f"{name} on an aborted communicator: NCCL has freed it")
        self.log.append(name)

    def check_async_error(self):
        self.call("check_async_error")

    def abort(self):
        self.call("abort")
        self.aborted.set()


class Event:
    def __init__(self, *args, **kwargs):
        self.done = False


class Stream:
    ptr = 0

    def __init__(self, done: bool, after: float = 0.0):
        self.recorded_done, self.after = done, after  # done at once, never, or `after` seconds from its record

    def record(self, event):
        event.done = self.recorded_done and not self.after
        if self.after:
            threading.Timer(self.after, lambda: setattr(event, "done", True)).start()
        return event


class Device:
    def __init__(self, ordinal):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture
def fake_cuda(monkeypatch):
    """cupy.cuda's Device and Event as stand-ins, and a short grace for aborts to wait for a hung launch."""
    monkeypatch.setattr(cupy.cuda, "Device", Device)
    monkeypatch.setattr(cupy.cuda, "Event", Event)
    monkeypatch.setattr(nccl_comms, "LAUNCH_GRACE", 0.2)


class FakeCommunicators(Communicators):
    """Communicators whose cliques hold stand-in communicators; counts how many cliques it created."""

    def __init__(self, log: list):
        super().__init__()
        self.log, self.created = log, []

    def _create(self, clique, operation):
        clique.comms.extend(Comm(self.log) for _ in clique.ordinals)
        self.created.append(clique)


def test_a_launch_that_hangs_inside_nccl_is_aborted_at_its_deadline(fake_cuda):
    log = []
    comms = FakeCommunicators(log)

    def hangs_until_aborted(rank, comm, stream):  # as a first collective waits for a peer that never connects
        comm.call("all_reduce")
        assert comm.aborted.wait(10), "the watchdog never aborted the hung launch"
        raise nccl.NcclError(3)  # what NCCL returns once its communicator is aborted

    start = time.monotonic()
    with pytest.raises(DeadlineExceededError, match=r"^all_reduce did not complete within 0\.1 s on GPUs \[0\]"):
        comms.run("all_reduce", [0], [Stream(done=True)], hangs_until_aborted, timeout=0.1)
    assert time.monotonic() - start < 5
    # the watchdog polls NCCL's asynchronous errors meanwhile (NCCL allows that from another thread), never after
    assert [call for call in log if call != "check_async_error"] == ["all_reduce", "abort"]
    assert log[-1] == "abort"
    comms.check()  # raised once


def test_creating_the_communicators_does_not_count_against_the_first_collectives_deadline(fake_cuda):
    log = []

    class SlowToCreate(FakeCommunicators):
        def _create(self, clique, operation):
            time.sleep(0.25)  # NCCL's initialisation takes time of its own, within the timeout
            super()._create(clique, operation)

    comms = SlowToCreate(log)
    launch = lambda rank, comm, stream: comm.call("all_reduce")  # noqa: E731
    comms.run("all_reduce", [0], [Stream(done=True, after=0.25)], launch, timeout=0.4)  # 0.5 s in all
    comms.wait()
    assert "abort" not in log


def test_communicators_made_after_their_creation_passed_the_deadline_are_aborted(fake_cuda):
    log = []

    class LateToCreate(FakeCommunicators):
        def _create(self, clique, operation):
            time.sleep(1.0)  # the ranks met (the unique id's broadcast) only after the deadline
            super()._create(clique, operation)

    comms = LateToCreate(log)
    with pytest.raises(DeadlineExceededError, match="^all_reduce did not complete within 0.1 s"):
        comms.run("all_reduce", [0], [Stream(done=True)], lambda rank, comm, stream: None, timeout=0.1)
    assert log == ["abort"]  # made after the watchdog's abort, aborted before anything used it


def test_an_abort_waits_for_a_launch_on_the_same_communicators_to_return():
    log = []
    clique = Clique((0,))
    clique.comms.append(Comm(log))
    inside = threading.Event()

    def launch():
        with clique.launching():
            inside.set()
            time.sleep(0.1)
            log.append("launch returned")

    thread = threading.Thread(target=launch)
    thread.start()
    inside.wait()
    assert clique.abort() is True
    thread.join()
    assert log == ["launch returned", "abort"]
    assert clique.abort() is False and log.count("abort") == 1  # once, whoever asks again


def test_two_threads_aborting_at_once_abort_once():
    log = []
    clique = Clique((0, 1))
    clique.comms.extend([Comm(log), Comm(log)])
    results = []
    threads = [threading.Thread(target=lambda: results.append(clique.abort())) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [False] * 7 + [True] and log == ["abort", "abort"]


def test_collectives_queued_behind_a_failed_one_fail_without_polling_its_aborted_communicators(fake_cuda):
    log = []
    comms = FakeCommunicators(log)
    launch = lambda rank, comm, stream: comm.call("all_reduce")  # noqa: E731
    comms.run("all_reduce", [0], [Stream(done=False)], launch, timeout=0.05)  # never completes
    comms.run("broadcast", [0], [Stream(done=False)], launch, timeout=60)  # queued behind it on the stream
    with pytest.raises(DeadlineExceededError, match=r"^all_reduce did not complete"):
        comms.wait()
    assert log.count("abort") == 1 and "check_async_error" not in log[log.index("abort"):]
    assert comms.watchdog.pending() == 0
    comms.check()  # the broadcast, cut short by the same abort, adds no second error
    comms.run("all_reduce", [0], [Stream(done=True)], launch, timeout=60)  # the next one gets new communicators
    comms.wait()
    assert len(comms.created) == 2


@pytest.mark.parametrize("failure, raised, message", [
    (nccl.NcclError(2), CollectiveError, r"^all_reduce failed on GPUs \[0, 1\]: NCCL reported"),
    (TypeError("an argument of the wrong type"), TypeError, "^an argument of the wrong type"),
])
def test_a_launch_that_raises_aborts_the_ranks_already_queued(fake_cuda, failure, raised, message):
    log = []
    comms = FakeCommunicators(log)

    def second_rank_fails(rank, comm, stream):
        comm.call(f"all_reduce rank {rank}")
        if rank == 1:
            raise failure

    with pytest.raises(raised, match=message) as info:
        comms.run("all_reduce", [0, 1], [Stream(True), Stream(True)], second_rank_fails, timeout=60)
    if raised is CollectiveError:
        assert info.value.status == 2 and info.value.__cause__ is failure
    # rank 0's call was queued by the group: without an abort it would wait for rank 1 forever, unwatched
    assert [call for call in log if call != "check_async_error"] == [
        "all_reduce rank 0", "all_reduce rank 1", "abort", "abort"]
    assert comms.watchdog.pending() == 0
    comms.check()  # the launch's own error was raised; nothing is left for the next synchronisation point
