"""Data-parallel linear regression with MirroredStrategy: shard a batch, all-reduce gradients, check the result.

Runs on every GPU when the CUDA backend is available, else on the CPU emulator with $DISTRIB_CPU_REPLICAS
replicas (default 2); `--replicas N` forces N emulated CPU replicas; `mpirun -np 2 python examples/quickstart.py`
runs it on every replica of two processes (`--replicas N`: N each). It trains the same model on one replica
and on N replicas from the same data and shows that the weights agree, which is what data parallelism
promises.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import distrib


def make_data(rows: int, features: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, features)).astype(np.float32)
    true_w = rng.normal(size=features).astype(np.float32)
    y = x @ true_w + np.float32(0.5) + rng.normal(scale=0.01, size=rows).astype(np.float32)
    return x, y, true_w


def train(strategy: distrib.Strategy, x: np.ndarray, y: np.ndarray, steps: int, lr: float):
    """Full-batch gradient descent; each replica takes an equal slice of the batch."""
    n = strategy.num_replicas_in_sync
    if len(x) % n:
        raise ValueError(f"{len(x)} rows do not split evenly over {n} replicas.")
    per_replica = len(x) // n
    shards = strategy.experimental_distribute_values_from_function(
        lambda ctx: (x[ctx.replica_id_in_sync_group * per_replica:][:per_replica],
                     y[ctx.replica_id_in_sync_group * per_replica:][:per_replica]))
    w = np.zeros(x.shape[1], np.float32)
    b = np.float32(0.0)

    def step(x_local, y_local, w, b):
        err = x_local @ w + b - y_local
        grads = {"w": 2.0 * x_local.T @ err / len(err), "b": 2.0 * err.mean()}
        # Every replica's local batch has the same size, so the mean of local means is the global mean.
        grads = distrib.get_replica_context().all_reduce("MEAN", grads)
        return grads, (err * err).mean()

    losses = []
    for _ in range(steps):
        grads, loss = strategy.run(step, args=(*shards, w, b))
        grads = strategy.experimental_local_results(grads)[0]  # identical on every replica after all_reduce
        w = w - np.float32(lr) * grads["w"]
        b = b - np.float32(lr) * grads["b"]
        losses.append(float(strategy.reduce("MEAN", loss, axis=None)))
    return w, b, losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=None, help="emulated CPU replicas, per process under "
                                                                   "mpirun (default: all GPUs, else "
                                                                   "$DISTRIB_CPU_REPLICAS or 2)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args(argv)
    for flag, value in (("--replicas", args.replicas), ("--steps", args.steps), ("--rows", args.rows)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1. Received: {value}.")
    if not 0 < args.lr < float("inf"):
        parser.error(f"--lr must be a finite number above 0. Received: {args.lr}.")

    if distrib.cluster_resolver.MPIClusterResolver().num_tasks("worker") > 1:  # launched by mpirun -np N (N > 1)
        if args.replicas is not None:  # read when the strategy is made: this process's emulated devices
            os.environ["DISTRIB_CPU_REPLICAS"] = str(args.replicas)
        strategy = distrib.MultiWorkerMirroredStrategy()  # every replica of every process in one sync group
    else:
        devices = None if args.replicas is None else [f"CPU:{i}" for i in range(args.replicas)]
        strategy = distrib.MirroredStrategy(devices)
    chief = strategy.extended.should_checkpoint  # rank 0 of a multi-worker job; True in one process
    if args.rows % strategy.num_replicas_in_sync:  # each replica takes an equal slice
        parser.error(f"--rows must divide evenly over the {strategy.num_replicas_in_sync} replicas. Received: "
                     f"{args.rows}.")
    x, y, true_w = make_data(args.rows, 8)
    report = print if chief else (lambda *_: None)  # the chief alone reports
    report(f"strategy: {strategy!r}, {strategy.num_replicas_in_sync} replicas, {args.rows} rows")

    start = time.perf_counter()
    w, b, losses = train(strategy, x, y, args.steps, args.lr)
    elapsed = time.perf_counter() - start
    for k in sorted({0, len(losses) // 4, len(losses) // 2, len(losses) - 1}):
        report(f"step {k + 1:4d}  loss {losses[k]:.6f}")
    report(f"{args.steps} steps in {elapsed:.3f} s ({args.steps / elapsed:.0f} steps/s)")

    w1, b1, _ = train(distrib.MirroredStrategy([strategy.extended.worker_devices[0]]), x, y, args.steps, args.lr)
    report(f"max |w - w_1 replica| = {np.abs(w - w1).max():.2e}, |b - b_1 replica| = {abs(b - b1):.2e}")
    report(f"max |w - true w|      = {np.abs(w - true_w).max():.2e}, b = {b:.4f} (true 0.5)")
    if not np.isfinite(w).all():  # the step size, not data parallelism: one replica diverges alike
        raise SystemExit(f"training diverged (the weights are not finite): a smaller --lr than {args.lr} converges")
    if not np.allclose(w, w1, rtol=1e-5, atol=1e-5):
        raise SystemExit("data-parallel training diverged from single-replica training")


if __name__ == "__main__":
    main()
