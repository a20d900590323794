"""wait_chain: which thread waits, through joins and futures and without a timeout, for another."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import threading
import time

import pytest

from distrib.thread_waits import _current_frames, wait_chain

pytestmark = pytest.mark.timeout(30)


def chain_seen_from_inside(start_waiting, until=None) -> list[str] | None:
    """Runs `start_waiting(target)` on a thread named 'waiter'; returns the chain from the waiter to `target`
    (a thread that the waiter waits for) that `target` first sees within 5 s, or sees once some thread waits
    in the function `until`."""
    seen = []

    def target():
        deadline = time.monotonic() + 5
        while True:
            # the collector held off, as the library reads stacks (CPython 3.11 can deadlock otherwise)
            settled = until is not None and any(waiting_in(f, until) for f in _current_frames().values())
            chain = wait_chain([waiter.ident], threading.get_ident())
            if chain is not None or settled or time.monotonic() > deadline:
                seen.append(chain)
                return
            time.sleep(0.01)

    waiter = threading.Thread(target=start_waiting, args=(target,), name="waiter")
    waiter.start()
    waiter.join()
    return seen[0]


def waiting_in(frame, function) -> bool:
    """Whether `function` is one of the innermost frames of a thread, whose innermost frame is `frame`."""
    for _ in range(4):
        if frame is None:
            return False
        if frame.f_code is function.__code__:
            return True
        frame = frame.f_back
    return False


def test_a_join_through_a_second_thread_is_one_chain():
    def start_waiting(target):
        inner = threading.Thread(target=target, name="inner")
        middle = threading.Thread(target=lambda: (inner.start(), inner.join()), name="middle")
        middle.start()
        middle.join()

    assert chain_seen_from_inside(start_waiting) == ["'waiter' waits in Thread.join for 'middle'",
                                                     "'middle' waits in Thread.join for 'inner'"]


def test_waiting_for_all_futures_counts_and_waiting_with_a_timeout_does_not():
    def wait_for_all(target):
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pool") as pool:
            concurrent.futures.wait([pool.submit(target)])

    def wait_a_while(target):
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pool") as pool:
            pool.submit(target).result(timeout=5)

    assert chain_seen_from_inside(wait_for_all) == ["'waiter' waits in concurrent.futures.wait for 'pool_0'"]
    assert chain_seen_from_inside(wait_a_while, until=concurrent.futures.Future.result) is None


HOLDS_LOCALS_IN_GARBAGE = """
import gc, threading, time
from distrib.thread_waits import _current_frames, wait_chain

stop = threading.Event()
def nap():  # a fresh frame each time: reading the stacks has to allocate frame objects
    time.sleep(0.0002)
def busy():
    while not stop.is_set():
        nap()
threads = [threading.Thread(target=busy) for _ in range(4)]
for thread in threads:
    thread.start()

class Holder:
    pass

gc.set_threshold(1)  # a collection at every allocation
for _ in range(2000):
    for _ in range(5):  # cyclic garbage holding a threading.local
        holder = Holder(); holder.local = threading.local(); holder.local.x = 1; holder.me = holder
    del holder
    wait_chain([thread.ident for thread in threads], -1)
stop.set()
print("done")
"""


def test_reading_the_stacks_while_garbage_holds_thread_locals_never_hangs():
    # CPython 3.11 collects garbage inside sys._current_frames() with its thread-list lock held; a threading.local
    # freed there takes that lock again and the process hangs for good (this hung the test suite once)
    done = subprocess.run([sys.executable, "-c", HOLDS_LOCALS_IN_GARBAGE], capture_output=True, text=True,
                          timeout=25)
    assert done.stdout.strip() == "done", done.stderr
