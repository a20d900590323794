"""NCCL on a GPU: collectives return once queued, the watchdog's deadlines, and errors translated at the edge."""

from __future__ import annotations

import numpy as np
import pytest

from distrib.backends import get_backend
from distrib.errors import CollectiveError, DeadlineExceededError

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")
from distrib.backends.cuda import nccl as nccl_comms  # noqa: E402  (imports CuPy: after the skip)


@pytest.fixture(scope="module")
def backend():
    return get_backend("cuda")


# -- the watchdog and error translation --------------------------------------------------------------------------------

SPIN = r'''
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
'''


def test_a_collective_past_its_deadline_aborts_and_the_next_one_works(backend):
    spin = cupy.RawKernel(SPIN, "spin")
    flat = backend.to_device(np.ones(8, np.float32), "GPU:0")
    with backend.device_scope("GPU:0"):
        spin((1,), (1,), (np.int64(5 * 10**9),))  # seconds of work queued before the all-reduce on the same stream
    backend.all_reduce([flat], [(0, 8)], ["GPU:0"], False, timeout=0.2)  # returns at once: queued behind the spin
    with pytest.raises(DeadlineExceededError, match=r"^all_reduce did not complete within 0\.2 s on GPUs \[0\]"):
        backend.synchronize()  # the next synchronisation point raises what the watchdog found
    backend.synchronize()  # raised once: the backend stays usable
    (out,) = backend.all_reduce([flat], [(0, 8)], ["GPU:0"], False)
    np.testing.assert_array_equal(out.get(), np.ones(8, np.float32))


def test_a_copy_to_the_host_after_a_collective_past_its_deadline_raises_its_error(backend):
    spin = cupy.RawKernel(SPIN, "spin")
    flat = backend.to_device(np.ones(8, np.float32), "GPU:0")
    with backend.device_scope("GPU:0"):
        spin((1,), (1,), (np.int64(2 * 10**9),))
    (out,) = backend.all_reduce([flat], [(0, 8)], ["GPU:0"], False, timeout=0.2)
    # the abort ends the collective's kernel, so the copy returns; the error must not be lost to a race with the
    # watchdog's thread, which keeps it only once the abort has returned
    with pytest.raises(DeadlineExceededError, match=r"^all_reduce did not complete within 0\.2 s"):
        backend.to_host(out)
    backend.synchronize()


def test_collectives_return_before_the_gpu_has_run_them(backend):
    spin = cupy.RawKernel(SPIN, "spin")
    flat = backend.to_device(np.ones(8, np.float32), "GPU:0")
    with backend.device_scope("GPU:0"):
        spin((1,), (1,), (np.int64(10**9),))
    outs = [backend.all_reduce([flat], [(0, 8)], ["GPU:0"], False)[0] for _ in range(3)]
    assert backend._comms.watchdog.pending() >= 1  # the caller was not held until completion
    backend.synchronize()
    assert backend._comms.watchdog.pending() == 0
    for out in outs:
        np.testing.assert_array_equal(out.get(), np.ones(8, np.float32))


def test_out_of_memory_is_resource_exhausted_naming_the_operation(backend):
    from distrib.errors import ResourceExhaustedError

    with pytest.raises(ResourceExhaustedError, match="^empty ran out of GPU memory"):
        backend.empty((1 << 50,), np.float32, "GPU:0")  # a petabyte


def test_nccl_errors_become_collective_errors_naming_the_operation(backend):
    comms = nccl_comms.Communicators()
    flat = cupy.ones(4, np.float32)

    def invalid_datatype(rank, comm, stream):
        comm.allReduce(flat.data.ptr, flat.data.ptr, 4, 99, 0, stream)

    with pytest.raises(CollectiveError, match=r"^all_reduce failed on GPUs \[0\]: NCCL reported") as info:
        comms.run("all_reduce", [0], [backend._stream(0)], invalid_datatype, timeout=10)
    assert info.value.status is not None and info.value.__cause__ is not None
    (clique,) = comms._groups.values()
    assert clique.aborted and not any(comm.comm for comm in clique.comms)  # aborted: CuPy zeroed the handles


def test_two_threads_all_reducing_over_the_same_gpus_in_opposite_orders_both_finish(backend):
    if len(backend.gpus) < 2:
        pytest.skip("needs 2 GPUs: device tuples (0, 1) and (1, 0) sharing both streams")
    import threading

    errors = []

    def loop(devices):
        try:
            flats = [backend.to_device(np.full(1 << 16, 1.0, np.float32), d) for d in devices]
            for _ in range(200):
                flats = backend.all_reduce(flats, [(0, 1 << 16)], devices, True, timeout=30)
            backend.synchronize()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(devices,)) for devices in (["GPU:0", "GPU:1"], ["GPU:1", "GPU:0"])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads) and not errors, errors
