"""Train a small MLP on the bundled 8x8 digits, data-parallel: the model to copy when you start your own.

    python3 examples/train_mlp.py                 # every GPU, else 2 emulated CPU replicas
    python3 examples/train_mlp.py --replicas 4    # 4 emulated CPU replicas

It is `distrib train` without the run directory, resuming and precision flags: a strategy, variables made in
its scope, a distributed dataset, a replica step that computes its local gradients, and an optimizer that
averages them across replicas.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import distrib
from distrib.datasets import load_digits


def init_weights(features: int, hidden: int, classes: int, seed: int) -> dict[str, distrib.Variable]:
    """He-initialised weights. Call inside `strategy.scope()`, so each becomes a MirroredVariable."""
    rng = np.random.default_rng(seed)
    return {
        "w1": distrib.Variable(rng.normal(0, np.sqrt(2 / features), (features, hidden)).astype(np.float32), name="w1"),
        "b1": distrib.Variable(np.zeros(hidden, np.float32), name="b1"),
        "w2": distrib.Variable(rng.normal(0, np.sqrt(2 / hidden), (hidden, classes)).astype(np.float32), name="w2"),
        "b2": distrib.Variable(np.zeros(classes, np.float32), name="b2"),
    }


def forward(weights, x, xp):
    """Logits and the hidden activations (kept for the backward pass)."""
    pre = x @ weights["w1"].read_value() + weights["b1"].read_value()
    hidden = xp.maximum(pre, 0)
    return hidden @ weights["w2"].read_value() + weights["b2"].read_value(), pre, hidden


def loss_and_grads(weights, x, y, xp):
    """Mean softmax cross-entropy over this replica's rows, and its gradients (backpropagation by hand)."""
    logits, pre, hidden = forward(weights, x, xp)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
    rows = xp.arange(len(y))
    loss = -log_probs[rows, y].mean()
    d_logits = xp.exp(log_probs)
    d_logits[rows, y] -= 1
    d_logits /= len(y)  # the gradient of the *local mean*; the optimizer averages the replicas' gradients
    d_hidden = (d_logits @ weights["w2"].read_value().T) * (pre > 0)
    grads = {"w1": x.T @ d_hidden, "b1": d_hidden.sum(axis=0), "w2": hidden.T @ d_logits, "b2": d_logits.sum(axis=0)}
    return loss, grads


def shuffled_batches(x, y, batch_size: int, seed: int):
    """Full global batches in a new random order each epoch (the partial last one is dropped)."""
    order = np.random.default_rng(seed).permutation(len(x))
    for start in range(0, len(x) - batch_size + 1, batch_size):
        rows = order[start:start + batch_size]
        yield x[rows], y[rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, help="emulated CPU replicas (default: every GPU, else 2)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split over the replicas")
    parser.add_argument("--learning-rate", type=float, default=0.003)
    args = parser.parse_args()

    devices = None if args.replicas is None else [f"CPU:{i}" for i in range(args.replicas)]
    strategy = distrib.MirroredStrategy(devices)
    xp = strategy.extended.backend.xp  # numpy on the CPU emulator, cupy on GPUs
    x_train, y_train, x_test, y_test = load_digits()
    with strategy.scope():
        weights = init_weights(x_train.shape[1], 128, 10, seed=0)
        optimizer = distrib.optimizers.Adam(args.learning_rate)

    def train_step(x, y):  # runs once per replica, on its share of the global batch
        loss, grads = loss_and_grads(weights, x, y, xp)
        optimizer.apply_gradients([(grads[name], weights[name]) for name in weights])
        return loss

    def count_correct(x, y):
        logits, _, _ = forward(weights, x, xp)
        return (logits.argmax(axis=1) == y).sum()

    start = time.perf_counter()
    for epoch in range(args.epochs):
        batches = strategy.experimental_distribute_dataset(
            shuffled_batches(x_train, y_train, args.batch_size, seed=epoch))
        for x, y in batches:
            loss = strategy.reduce("MEAN", strategy.run(train_step, args=(x, y)), axis=None)
        test = strategy.experimental_distribute_dataset(
            [(x_test[i:i + 256], y_test[i:i + 256]) for i in range(0, len(x_test), 256)])
        correct = sum(int(strategy.reduce("SUM", strategy.run(count_correct, args=batch), axis=None))
                      for batch in test)
        print(f"epoch {epoch + 1:2d}  loss {float(loss):.4f}  test accuracy {correct / len(x_test):.2%}")
    seconds = time.perf_counter() - start
    samples = args.epochs * (len(x_train) // args.batch_size) * args.batch_size
    print(f"{strategy.num_replicas_in_sync} replicas: {seconds:.1f} s, {samples / seconds:,.0f} samples/s")


if __name__ == "__main__":
    main()
