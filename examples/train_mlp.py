"""Train a small MLP on the bundled 8x8 digits, data-parallel: the model to copy when you start your own.

    python3 examples/train_mlp.py                 # every GPU, else $DISTRIB_CPU_REPLICAS (default 2) emulated replicas
    python3 examples/train_mlp.py --replicas 4    # 4 emulated CPU replicas
    mpirun -np 2 python3 examples/train_mlp.py    # 2 processes (each with every local GPU, or 2 emulated replicas)
    mpirun -np 2 python3 examples/train_mlp.py --replicas 1   # 2 processes of 1 emulated replica each

It trains `distrib train`'s model (distrib/cli/model.py) on the same data, with a shuffle of its own (so its
losses differ from the command's), and without the run directory, resuming and precision flags: a strategy, variables made in its scope, a distributed dataset, a replica step that computes
its local gradients, and an optimizer that averages them across replicas.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import distrib
from distrib.cli.model import MLP  # the model `distrib train` trains: read it there
from distrib.datasets import load_digits


def shuffled_batches(x, y, batch_size: int, seed: int):
    """Full global batches in a new random order each epoch (the partial last one is dropped)."""
    order = np.random.default_rng(seed).permutation(len(x))
    for start in range(0, len(x) - batch_size + 1, batch_size):
        rows = order[start:start + batch_size]
        yield x[rows], y[rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, help="emulated CPU replicas, per process under mpirun (default: "
                                                     "every GPU, else $DISTRIB_CPU_REPLICAS, else 2)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split over the replicas")
    parser.add_argument("--learning-rate", type=float, default=0.003)
    args = parser.parse_args()
    x_train, y_train, x_test, y_test = load_digits()
    for flag, value in (("--replicas", args.replicas), ("--epochs", args.epochs), ("--batch-size", args.batch_size)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1. Received: {value}.")
    if args.batch_size > len(x_train):  # no full batch: no step would run
        parser.error(f"--batch-size must be at most the {len(x_train)} training rows. Received: {args.batch_size}.")
    if not 0 < args.learning_rate < float("inf"):
        parser.error(f"--learning-rate must be a finite number above 0. Received: {args.learning_rate}.")

    if distrib.cluster_resolver.MPIClusterResolver().num_tasks("worker") > 1:  # launched by mpirun -np N (N > 1)
        if args.replicas is not None:  # read when the strategy is made: this process's emulated devices
            os.environ["DISTRIB_CPU_REPLICAS"] = str(args.replicas)
        strategy = distrib.MultiWorkerMirroredStrategy()  # every replica of every process in one sync group
    else:
        devices = None if args.replicas is None else [f"CPU:{i}" for i in range(args.replicas)]
        strategy = distrib.MirroredStrategy(devices)
    chief = strategy.extended.should_checkpoint  # rank 0 of a multi-worker job; True in one process
    xp = strategy.extended.backend.xp  # numpy on the CPU emulator, cupy on GPUs
    with strategy.scope():
        model = MLP(xp, x_train.shape[1], 128, 10, seed=0)  # its weights become MirroredVariables
        optimizer = distrib.optimizers.Adam(args.learning_rate)

    def train_step(x, y):  # runs once per replica, on its share of the global batch
        loss, grads = model.loss_and_gradients(x, y, xp.float32)  # the gradients of this replica's mean loss
        optimizer.apply_gradients(list(zip(grads, model.variables.values())))  # averaged across replicas
        return loss

    def count_correct(x, y):
        return (model.logits(x, xp.float32).argmax(axis=1) == y).sum()

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
        if chief:
            print(f"epoch {epoch + 1:2d}  loss {float(loss):.4f}  test accuracy {correct / len(x_test):.2%}")
    seconds = time.perf_counter() - start
    samples = args.epochs * (len(x_train) // args.batch_size) * args.batch_size
    if chief:
        print(f"{strategy.num_replicas_in_sync} replicas: {seconds:.1f} s, {samples / seconds:,.0f} samples/s")


if __name__ == "__main__":
    main()
