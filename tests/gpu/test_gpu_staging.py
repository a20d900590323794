"""Input staging on a GPU: chunked parallel copies through pooled pinned memory arrive whole and in order."""

from __future__ import annotations

import numpy as np
import pytest

from distrib.backends import get_backend

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")
from distrib.backends.cuda import staging  # noqa: E402  (imports CuPy: after the skip)


@pytest.fixture(scope="module")
def backend():
    return get_backend("cuda")


@pytest.mark.parametrize("nbytes", [1, 4096 + 3, staging.CHUNK_BYTES, 3 * staging.CHUNK_BYTES + 5])
def test_prefetched_batches_arrive_byte_for_byte(backend, nbytes):
    rng = np.random.default_rng(nbytes)
    batch = [rng.integers(0, 256, nbytes, dtype=np.uint8), rng.standard_normal((7, 3)).astype(np.float32)]
    out = backend.prefetch_to_device(batch, "GPU:0")
    with backend.device_scope("GPU:0"):
        np.testing.assert_array_equal(out[0].get(), batch[0])
        np.testing.assert_array_equal(out[1].get(), batch[1])


def test_values_in_the_other_byte_order_arrive_as_their_values(backend):
    # CuPy copies a byte-swapped array's bytes as if they were native: both upload paths convert them first
    values = (np.arange(6) * 300 + 255).astype(np.dtype(np.float32).newbyteorder("S")).reshape(2, 3)
    prefetched = backend.prefetch_to_device([values, values[:, ::2]], "GPU:0")
    placed = backend.to_device(values, "GPU:0")
    with backend.device_scope("GPU:0"):
        for out, expected in zip([*prefetched, placed], [values, values[:, ::2], values]):
            np.testing.assert_array_equal(out.get(), expected)


def test_pinned_buffers_are_reused_once_their_copies_have_completed(backend):
    batch = [np.ones(2 * staging.CHUNK_BYTES, np.uint8)]
    backend.prefetch_to_device(batch, "GPU:0")
    backend.synchronize()
    pool = backend._stager.pool
    first = pool.take(batch[0].nbytes)  # the buffer of the finished copy comes back
    pool.release_after(type("Done", (), {"done": True})(), [(batch[0].nbytes, first)])
    assert pool.take(batch[0].nbytes) is first


def test_a_batch_changed_after_prefetch_does_not_change_what_arrived(backend):
    host = np.arange(3 * staging.CHUNK_BYTES // 4, dtype=np.float32)
    (out,) = backend.prefetch_to_device([host], "GPU:0")
    expected = host.copy()
    host[:] = -1  # the staging copy was taken before prefetch returned
    with backend.device_scope("GPU:0"):
        np.testing.assert_array_equal(out.get(), expected)


def test_a_value_cupy_cannot_hold_fails_the_batch_before_any_copy_is_queued(backend):
    pool = backend._stager.pool
    backend.synchronize()
    pool.take(1)  # reclaims what earlier tests left busy
    busy = len(pool._busy)
    batch = [np.ones(2 * staging.CHUNK_BYTES, np.uint8), np.array(["no GPU dtype"])]  # CuPy has no str dtype
    with pytest.raises(TypeError, match=r"cannot hold dtype <U12 on a GPU\. Received: an array of dtype <U12 and "
                                         r"shape \(1,\)") as prefetched:  # as to_device says it, not CuPy's ValueError
        backend.prefetch_to_device(batch, "GPU:0")
    assert len(pool._busy) == busy  # every device array is allocated before the first copy: nothing to hold
    with pytest.raises(TypeError) as placed:
        backend.to_device(batch[1], "GPU:0")
    assert str(placed.value) == str(prefetched.value)


def test_a_batch_that_fails_part_way_keeps_the_pinned_buffers_of_the_copies_already_queued(backend, monkeypatch):
    pool = backend._stager.pool
    backend.synchronize()
    pool.take(1)  # reclaims what earlier tests left busy
    busy = len(pool._busy)
    batch = [np.ones(2 * staging.CHUNK_BYTES, np.uint8), np.ones(staging.CHUNK_BYTES, np.uint8)]
    upload, calls = backend._stager.upload, []

    def fails_the_second(host, out, stream):  # staging the second value fails once the first is queued
        calls.append(host)
        if len(calls) == 2:
            raise MemoryError("no pinned memory left")
        return upload(host, out, stream)

    monkeypatch.setattr(backend._stager, "upload", fails_the_second)
    with pytest.raises(MemoryError):
        backend.prefetch_to_device(batch, "GPU:0")
    assert len(pool._busy) == busy + 1  # held until the first value's copy has completed, then reused
    (_, buffers), = list(pool._busy)[busy:]
    assert [nbytes for nbytes, _ in buffers] == [batch[0].nbytes]
    backend.synchronize()
    assert pool.take(batch[0].nbytes) is buffers[0][1]
