"""The CUDA backend on a GPU: discovery, placement, input prefetch, strategies reducing to the host."""

from __future__ import annotations

import numpy as np
import pytest

import distrib
from distrib.backends import get_backend
from gpu_support import shared_gpu_and_emulator

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")


@pytest.fixture(scope="module")
def backend():
    return get_backend("cuda")


# -- discovery ---------------------------------------------------------------------------------------------------------


def test_nvml_names_each_gpu_by_the_uuid_cuda_gives_its_ordinal(backend):
    from distrib.backends.cuda.devices import cuda_gpus

    by_cuda = cuda_gpus()
    assert [g.pci_bus_id.lower() for g in backend.gpus] == [g.pci_bus_id.lower() for g in by_cuda]
    # CuPy reads CUDA's 16-byte UUID as a C string: one holding a zero byte arrives short, and reads "GPU-unknown"
    assert all(nvml.uuid == cuda.uuid for nvml, cuda in zip(backend.gpus, by_cuda) if cuda.uuid != "GPU-unknown")
    assert backend.default_devices() == tuple(f"GPU:{k}" for k in range(cupy.cuda.runtime.getDeviceCount()))


def test_prefetch_to_device_delivers_the_batches_ordered_on_the_device_stream(backend):
    rng = np.random.default_rng(7)
    batches = [[rng.standard_normal((256, 64)).astype(np.float32), rng.integers(0, 10, 256).astype(np.int32),
                np.zeros((0, 3), np.float32)] for _ in range(6)]
    placed = [backend.prefetch_to_device(batch, "GPU:0") for batch in batches]
    with backend.device_scope("GPU:0"):  # kernels on the device's stream see the copied data without a host wait
        sums = [float(arrays[0].sum()) for arrays in placed]
    for batch, arrays, total in zip(batches, placed, sums):
        for host, device in zip(batch, arrays):
            assert device.shape == host.shape and device.dtype == host.dtype
            np.testing.assert_array_equal(device.get(), host)
        assert total == pytest.approx(float(batch[0].sum()), rel=1e-4)


def test_distributed_dataset_on_the_gpu_matches_the_emulator():
    data = np.arange(40, dtype=np.float32).reshape(20, 2)
    batches = [data[i:i + 7] for i in range(0, 20, 7)]
    gpu, cpu = shared_gpu_and_emulator(4).values()
    for on_gpu, on_cpu in zip(gpu.experimental_distribute_dataset(batches), cpu.experimental_distribute_dataset(batches)):
        for a, b in zip(gpu.experimental_local_results(on_gpu), cpu.experimental_local_results(on_cpu)):
            np.testing.assert_array_equal(cupy.asnumpy(a), b)


def test_a_strategy_on_a_gpu_runs_and_reduces_to_host():
    strategy = distrib.MirroredStrategy(["GPU:0", "GPU:0"])
    out = strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", cupy.ones(3)))
    assert isinstance(strategy.experimental_local_results(out)[0], cupy.ndarray)
    np.testing.assert_array_equal(strategy.reduce("MEAN", out, axis=None), np.full(3, 2.0))


def test_a_timeline_on_the_gpu_records_each_collective_and_mirrors_its_spans_as_nvtx_ranges(backend, tmp_path,
                                                                                             monkeypatch):
    import json

    from distrib import timeline

    if not cupy.cuda.nvtx.available:
        pytest.skip("this CuPy was built without NVTX")
    push, pop = timeline._nvtx  # what the backend registered: CuPy's own NVTX calls
    assert (push, pop) == (cupy.cuda.nvtx.RangePush, cupy.cuda.nvtx.RangePop)
    names = []
    monkeypatch.setattr(timeline, "_nvtx", (lambda name: (names.append(name), push(name)), pop))  # still real NVTX
    strategy = distrib.MirroredStrategy(["GPU:0"])
    path = tmp_path / "trace.json"
    timeline.start(path)
    try:
        out = strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", cupy.ones(8, np.float32)))
        backend.synchronize()
    finally:
        timeline.stop()
    np.testing.assert_array_equal(cupy.asnumpy(strategy.experimental_local_results(out)[0]), np.ones(8))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    reductions = [e for e in events if e["cat"] in ("plan", "collective")]  # execute, or all_reduce
    assert reductions and all(e["dur"] >= 0 and e["tid"] is not None for e in events)
    assert {e["name"] for e in reductions} <= set(names)  # each was an NVTX range too
