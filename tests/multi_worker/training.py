"""The training run both sides of the multi-worker check execute: an MLP-free linear model, SGD with momentum."""

from __future__ import annotations

import numpy as np

import distrib

GLOBAL_BATCH, STEPS = 32, 12


def batches(steps: int = STEPS, first: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, 5)).astype(np.float32)
    y = (x @ np.arange(1, 6, dtype=np.float32) + 0.5).astype(np.float32)
    return [{"x": x[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH], "y": y[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH]}
            for i in range(first, first + steps)]


def build(strategy: distrib.Strategy, seed: int = 0):
    with strategy.scope():  # a seed per process: the chief's initial values must win
        w = distrib.Variable(np.random.default_rng(seed).normal(size=5).astype(np.float32), name="w")
        b = distrib.Variable(np.float32(0.0), name="b")
        optimizer = distrib.optimizers.SGD(learning_rate=0.05, momentum=0.9)
    return w, b, optimizer


def train(strategy: distrib.Strategy, w, b, optimizer, data) -> list[float]:
    def step(batch):
        x, y = batch["x"], batch["y"]
        err = x @ w.read_value() + b.read_value() - y
        grads = (2 * x.T @ err / max(len(x), 1), np.float32(2 * err.mean()) if len(x) else np.float32(0))
        optimizer.apply_gradients([(np.asarray(grads[0], np.float32), w), (np.asarray(grads[1], np.float32), b)])
        return np.float32((err ** 2).sum())

    losses = []
    for batch in strategy.experimental_distribute_dataset(data):
        losses.append(float(strategy.reduce("SUM", strategy.run(step, args=(batch,)), axis=None)) / GLOBAL_BATCH)
    return losses
