"""Fixtures shared by the strategy tests: a four-replica MirroredStrategy on emulated CPUs, and values on it."""

import pytest

import distrib
from distrib import backends
from support import DEVICES, CallCountingBackend, blocks_of


@pytest.fixture(scope="module")
def strategy():
    """Four emulated CPU replicas; a module that needs another strategy defines its own fixture."""
    return distrib.MirroredStrategy(DEVICES)


@pytest.fixture
def counting(monkeypatch):
    """A four-replica strategy on a CPU emulator of its own that counts its collectives: (strategy, backend)."""
    backend = CallCountingBackend()
    monkeypatch.setitem(backends._INSTANCES, "cpu", backend)
    strategy = distrib.MirroredStrategy(DEVICES)
    yield strategy, backend
    strategy.close()


@pytest.fixture(scope="module")
def blocks(strategy):
    """Replica r holds [[0, 1, 2], [3, 4, 5]] + 10 r."""
    return blocks_of(strategy)
