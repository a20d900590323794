"""Ctrl-C (a real SIGINT to a real process) never leaves mirrored copies unequal, reaches the caller promptly,
and leaves the strategy whole and usable."""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from support import default_sigint

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(os.name != "posix", reason="POSIX signals")]

INTERRUPTS = 6
RESEND_SECONDS = 5.0  # a child silent this long after a Ctrl-C lost it in a callback (see Child.interrupt_and_read)

PRELUDE = """
import json, signal, sys, threading, time
import numpy as np
import distrib

strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])

def copies_equal(variable):
    copies = [c.numpy() for c in variable.values]
    return all(np.array_equal(copies[0], c) for c in copies[1:])

def replica_threads():
    return sum(t.name.startswith("distrib-replica-") and t.is_alive() for t in threading.enumerate())

def settled_replica_threads(expected, timeout=10.0):
    # an interrupted run's retired threads end on their own time: wait for them before counting
    deadline = time.monotonic() + timeout
    while replica_threads() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return replica_threads()

def report(**fields):
    print(json.dumps(fields), flush=True)

def interrupt_on_entering(code, caller=None, nth=1):
    # a Ctrl-C at one point: SIGINT raised as this thread enters `code` (called from `caller`) for the nth time
    entries = []
    def tracer(frame, event, arg):
        if event == "call" and frame.f_code is code and (caller is None or frame.f_back.f_code is caller):
            entries.append(1)
            if len(entries) == nth:
                sys.settrace(None)
                signal.raise_signal(signal.SIGINT)
    sys.settrace(tracer)
"""


_children: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def no_child_outlives_its_test():
    """A child whose test failed half way would loop in its steps for good: it ends with its test."""
    yield
    while _children:
        process = _children.pop()
        if process.poll() is None:
            process.kill()
            process.wait()


class Child:
    """A Python process running `script` after PRELUDE, read line by line as JSON."""

    def __init__(self, script: str, loop: str = ""):
        source = PRELUDE + textwrap.dedent(script) + loop
        self.process = subprocess.Popen([sys.executable, "-c", source], stdout=subprocess.PIPE,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=default_sigint)
        self._unread = b""  # read from the pipe, not yet returned: two lines can arrive in one read
        _children.append(self.process)

    def read(self, timeout: float = 20.0) -> dict:
        line = self.read_within(timeout)
        assert line is not None, f"the child said nothing for {timeout} s"
        return line

    def read_within(self, timeout: float) -> dict | None:
        """The child's next line, or None if it says nothing for `timeout` seconds."""
        while b"\n" not in self._unread:
            ready, _, _ = select.select([self.process.stdout], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(self.process.stdout.fileno(), 65536)
            assert chunk, f"the child ended (exit status {self.process.wait()})"
            self._unread += chunk
        line, self._unread = self._unread.split(b"\n", 1)
        return json.loads(line)

    def interrupt(self) -> None:
        self.process.send_signal(signal.SIGINT)

    def interrupt_and_read(self) -> dict:
        """Ctrl-C, then the child's report. CPython drops a KeyboardInterrupt raised inside a weakref callback or a
        finalizer ("Exception ignored in ..."), such as threading's own WeakSet of threads, and the child then
        steps on as if never interrupted: so a child silent for RESEND_SECONDS gets another Ctrl-C (twice at most).
        """
        for _ in range(3):
            self.interrupt()
            line = self.read_within(RESEND_SECONDS)
            if line is not None:
                return line
        return self.read()

    def finish(self) -> int:
        try:
            return self.process.wait(timeout=20)
        finally:
            if self.process.poll() is None:
                self.process.kill()


def interrupt_repeatedly(child: Child) -> list[dict]:
    assert child.read() == {"ready": True}
    reports = []
    for _ in range(INTERRUPTS):
        time.sleep(random.uniform(0.02, 0.12))  # lands anywhere in the loop: mostly inside the updates
        reports.append(child.interrupt_and_read())
    return reports


LOOP = """
report(ready=True)
interrupts = 0
while interrupts < {interrupts}:
    try:
        while True:
            STEP()
    except KeyboardInterrupt:
        interrupts += 1
        report(equal=CHECK())
STEP()  # still usable
report(equal=CHECK(), threads=settled_replica_threads({threads}))
"""


FAST_LOOP = """
interrupts = 0
while interrupts < {interrupts}:
    try:
        report(armed=True)  # inside `try`: the next Ctrl-C, sent once this is read, cannot land outside it
        while True:
            STEP()
    except KeyboardInterrupt:
        interrupts += 1
        report(equal=CHECK())
STEP()
report(equal=CHECK(), threads=settled_replica_threads({threads}))
"""


def interrupt_quickly(child: Child, interrupts: int) -> None:
    """Interrupts `child` (running FAST_LOOP) `interrupts` times, each 0-2 ms after it is back in its steps."""
    for _ in range(interrupts):
        assert child.read() == {"armed": True}
        time.sleep(random.uniform(0, 0.002))
        assert child.interrupt_and_read() == {"equal": True}


def test_ctrl_c_during_cross_replica_updates_leaves_every_copy_equal():
    child = Child("""
        with strategy.scope():
            v = distrib.Variable(np.zeros(500_000, np.float32))  # each copy's update takes a while
        STEP = lambda: v.assign_add(np.float32(1))
        CHECK = lambda: copies_equal(v)
    """, LOOP.format(interrupts=INTERRUPTS, threads=0))
    reports = interrupt_repeatedly(child)
    assert reports == [{"equal": True}] * INTERRUPTS
    assert child.read() == {"equal": True, "threads": 0}  # no run: no replica threads
    assert child.finish() == 0


def test_ctrl_c_during_training_steps_leaves_variables_and_slots_equal_and_threads_usable():
    child = Child("""
        with strategy.scope():
            weights = [distrib.Variable(np.zeros(100_000, np.float32)) for _ in range(8)]
            optimizer = distrib.optimizers.Adam(0.01)

        def train_step():
            i = distrib.get_replica_context().replica_id_in_sync_group
            optimizer.apply_gradients([(np.full(w.shape, i + 1.0, np.float32), w) for w in weights])

        STEP = lambda: strategy.run(train_step)
        CHECK = lambda: all(copies_equal(w) for w in weights) and copies_equal(optimizer.iterations)
    """, LOOP.format(interrupts=INTERRUPTS, threads=4))
    reports = interrupt_repeatedly(child)
    assert reports == [{"equal": True}] * INTERRUPTS
    assert child.read() == {"equal": True, "threads": 4}
    assert child.finish() == 0


def test_ctrl_c_reaches_the_caller_promptly_and_the_stuck_replica_never_joins_a_later_run():
    child = Child("""
        gate, stale_collective = threading.Event(), threading.Event()
        first = True

        def step():
            ctx = distrib.get_replica_context()
            if first and ctx.replica_id_in_sync_group == 1:
                report(stuck=True)
                gate.wait()  # stuck in user code until the caller has been interrupted
                stale_collective.set()
            return ctx.all_reduce("SUM", np.float32(1000 if first else 1))

        try:
            strategy.run(step)
        except KeyboardInterrupt:
            report(interrupted=True)
        first = False
        gate.set()

        def later_step():
            stale_collective.wait(5)  # the interrupted run's replica 1 reaches its all_reduce about now
            return step()

        out = strategy.run(later_step)
        report(sums=[float(x) for x in strategy.experimental_local_results(out)])
        deadline = time.monotonic() + 5
        while replica_threads() > 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        report(threads=replica_threads())
    """)
    assert child.read() == {"stuck": True}
    child.interrupt()
    assert child.read(timeout=5.0) == {"interrupted": True}  # no waiting for the stuck replica
    assert child.read() == {"sums": [4.0, 4.0, 4.0, 4.0]}
    assert child.read() == {"threads": 4}
    assert child.finish() == 0


def test_ctrl_c_as_a_merge_leaves_its_frame_leaves_no_strategy_current():
    child = Child("""
        from distrib import context

        step = lambda: distrib.get_replica_context().all_reduce("SUM", np.float32(1))
        for mode in ("threads", "cooperative"):
            first = distrib.MirroredStrategy(["CPU:0", "CPU:1"], replica_execution=mode)
            # as the merge leaves its cross-replica frame, on the thread that called run
            interrupt_on_entering(context.frame.__exit__.__code__, type(first.extended)._merge.__code__)
            try:
                first.run(step)
                interrupted = False
            except KeyboardInterrupt:
                interrupted = True
            other = distrib.MirroredStrategy(["CPU:2", "CPU:3"], replica_execution=mode)
            out = other.run(step)
            report(mode=mode, interrupted=interrupted, current=repr(distrib.get_strategy()),
                   sums=[float(x) for x in other.experimental_local_results(out)])
    """)
    for mode in ("threads", "cooperative"):
        assert child.read() == {"mode": mode, "interrupted": True, "current": "<DefaultStrategy>", "sums": [2.0, 2.0]}
    assert child.finish() == 0


def test_ctrl_c_during_a_strategys_first_run_leaves_it_whole():
    child = Child("""
        strategies = []

        def step():
            return distrib.get_replica_context().all_reduce("SUM", np.float32(1))

        def STEP():  # a new strategy each time: its first run starts its threads
            strategies.append(distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"]))
            return strategies[-1].run(step)

        def CHECK():  # the last strategy, perhaps interrupted in its first run, runs whole
            out = strategies[-1].run(step)
            while len(strategies) > 1:  # the others end here, not at a Ctrl-C that would land in their finalizer
                strategies.pop(0).close()
            return [float(x) for x in strategies[-1].experimental_local_results(out)] == [4.0] * 4

        STEP()
    """, FAST_LOOP.format(interrupts=50, threads=4))
    interrupt_quickly(child, 50)
    assert child.read() == {"equal": True, "threads": 4}
    assert child.finish() == 0


def test_ctrl_c_as_a_nested_run_starts_its_threads_leaves_none_of_them_behind():
    child = Child("""
        from distrib.replica_threads import ReplicaThread

        def nested_run(s):  # a run from a merge_fn starts replica threads of its own
            interrupt_on_entering(ReplicaThread.__init__.__code__, nth=2)  # once the first one runs
            s.run(lambda: None)

        two = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
        two.run(lambda: None)  # starts its own two threads
        try:
            two.run(lambda: distrib.get_replica_context().merge_call(nested_run))
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        out = two.run(lambda: distrib.get_replica_context().all_reduce("SUM", np.float32(1)))
        report(interrupted=interrupted, sums=[float(x) for x in two.experimental_local_results(out)],
               threads=settled_replica_threads(2))
    """)
    assert child.read() == {"interrupted": True, "sums": [2.0, 2.0], "threads": 2}
    assert child.finish() == 0


def test_ctrl_c_anywhere_in_cooperative_steps_leaves_the_strategy_usable():
    # hundreds of interrupts a few hundred microseconds apart: some land in the scheduler as a replica switches
    child = Child("""
        cooperative = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"],
                                               replica_execution="cooperative")

        def step():
            return distrib.get_replica_context().all_reduce("SUM", np.float32(1))

        STEP = lambda: cooperative.run(step)
        CHECK = lambda: [float(x) for x in cooperative.experimental_local_results(STEP())] == [4.0] * 4
    """, FAST_LOOP.format(interrupts=300, threads=4))
    interrupt_quickly(child, 300)
    assert child.read() == {"equal": True, "threads": 4}
    assert child.finish() == 0


def test_outside_blocks_the_program_sees_its_own_sigint_handler_and_a_later_one_is_deferred_too():
    child = Child("""
        import signal
        from distrib.interrupts import deferred_interrupts

        with strategy.scope():
            v = distrib.Variable(np.zeros(3, np.float32))
        v.assign_add(np.float32(1))  # blocks opened and closed
        strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", np.float32(1)))
        report(default=signal.getsignal(signal.SIGINT) is signal.default_int_handler)

        calls = []
        def mine(signum, frame):
            calls.append(signum)

        saved = signal.signal(signal.SIGINT, mine)  # a program that swaps handlers after the first steps
        with deferred_interrupts():
            signal.raise_signal(signal.SIGINT)
            for _ in range(1000):
                pass  # Python runs a pending handler between bytecodes: here, were it not deferred
            inside = list(calls)
        report(saved=saved is signal.default_int_handler, inside=inside, after=calls,
               mine=signal.getsignal(signal.SIGINT) is mine)
    """)
    assert child.read() == {"default": True}
    assert child.read() == {"saved": True, "inside": [], "after": [signal.SIGINT], "mine": True}
    assert child.finish() == 0


ONE_REPLICA = """
one = distrib.MirroredStrategy(["CPU:0"])  # runs on the calling thread, its run lock taken without deferring

def runs_on_another_thread(timeout=10.0):
    results = []
    other = threading.Thread(target=lambda: results.append(float(one.run(lambda: np.float32(2)))), daemon=True)
    other.start()
    other.join(timeout)
    return results == [2.0]

def interrupt_on_returning_from(names):
    # a Ctrl-C as each C function named in `names` returns to the one-replica run: Python raises it there
    pending = list(names)
    def profiler(frame, event, arg):
        if event == "c_return" and pending and arg.__name__ == pending[0] and \\
                frame.f_code is type(one.extended)._run_at_once.__code__:
            pending.pop(0)
            if not pending:
                sys.setprofile(None)
            signal.raise_signal(signal.SIGINT)
    sys.setprofile(profiler)
"""


@pytest.mark.parametrize("returning_from", [["acquire"], ["acquire", "_is_owned"]],
                         ids=["as_the_lock_is_taken", "and_again_as_it_is_checked"])
def test_ctrl_c_as_a_one_replica_run_takes_its_lock_leaves_the_strategy_to_every_thread(returning_from):
    # the window `deferred_interrupts` would close, left open for speed: a Ctrl-C just after the lock is taken
    child = Child(ONE_REPLICA + f"""
interrupt_on_returning_from({returning_from!r})
try:
    one.run(lambda: np.float32(1))
    interrupted = False
except KeyboardInterrupt:
    interrupted = True
here = float(one.run(lambda: np.float32(1)))  # a second Ctrl-C left a hold: this thread's next run drops it
report(interrupted=interrupted, here=here, other_thread=runs_on_another_thread())
""")
    assert child.read() == {"interrupted": True, "here": 1.0, "other_thread": True}
    assert child.finish() == 0


def test_ctrl_c_anywhere_in_one_replica_steps_leaves_the_strategy_to_every_thread():
    child = Child(ONE_REPLICA + textwrap.dedent("""
        step = lambda: distrib.get_replica_context().all_reduce("SUM", np.ones(4, np.float32))
        STEP = lambda: one.run(step)
        CHECK = lambda: float(STEP()[0]) == 1.0 and runs_on_another_thread()
    """), FAST_LOOP.format(interrupts=200, threads=0))
    interrupt_quickly(child, 200)
    assert child.read() == {"equal": True, "threads": 0}
    assert child.finish() == 0
