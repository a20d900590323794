"""The main job, `distrib train`: a data-parallel MLP on the bundled 8x8 digits, with checkpoints and a loss curve.

Global batch semantics: each step takes one shuffled global batch, splits it evenly over the replicas, and each
replica computes the gradient of the MEAN loss over its own rows; the optimizer MEAN-reduces those gradients.
With local batches of equal size, the mean of the local means is the mean over the global batch, so N replicas
take the same step as one replica on the whole batch. That is why the global batch size must divide evenly
over the replicas, and why the partial last batch of an epoch is dropped rather than split unevenly: every step
then weighs every row equally, every step has the same shapes (which GPU kernels like), and since each epoch
reshuffles, a different handful of rows sits out each time. Evaluation needs no such care: it SUMs counts of
correct predictions, so it uses every test row.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from distrib.checkpoint import Checkpoint
from distrib.cli.model import MLP
from distrib.cli.progress import History, plot_history, progress_display
from distrib.datasets import DIGITS_CLASSES, load_digits
from distrib.mirrored import MirroredStrategy
from distrib.optimizers import SGD, Adam
from distrib.strategy import Strategy
from distrib.variables import Variable

DEFAULT_LEARNING_RATES = {"adam": 0.003, "sgd": 0.05}

def compute_dtype(precision: str, xp):
    """The array dtype for `--precision` on this array module; ValueError where it has none."""
    if precision != "bfloat16":
        return xp.dtype(precision)
    if xp is not np:
        raise ValueError(f"--precision bfloat16 is not available: {xp.__name__} has no bfloat16 arrays. "
                         f"Use --precision float16.")
    if importlib.util.find_spec("ml_dtypes") is None:
        raise ValueError("--precision bfloat16 on the CPU emulator needs ml_dtypes (NumPy has no bfloat16 of its "
                         "own): pip install ml_dtypes, or use --precision float16.")
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


def make_optimizer(name: str, learning_rate: float, momentum: float | None):
    """Adam or SGD from distrib.optimizers (create it under `strategy.scope()`)."""
    if name == "adam":
        return Adam(learning_rate=learning_rate)
    return SGD(learning_rate=learning_rate, momentum=momentum or 0.0)


# -- input ---------------------------------------------------------------------------------------------

def epoch_batches(x: np.ndarray, y: np.ndarray, global_batch_size: int, seed: int, epoch: int):
    """The epoch's full global batches, shuffled by (seed, epoch); the partial last batch is dropped."""
    order = np.random.default_rng([seed, epoch]).permutation(len(x))
    for start in range(0, len(order) - global_batch_size + 1, global_batch_size):
        rows = order[start:start + global_batch_size]
        yield x[rows], y[rows]


def test_batches(x: np.ndarray, y: np.ndarray, global_batch_size: int):
    """The test set in order, the last batch partial."""
    for start in range(0, len(x), global_batch_size):
        yield x[start:start + global_batch_size], y[start:start + global_batch_size]


# -- the loop --------------------------------------------------------------------------------------------

@dataclass
class Result:
    """What `train` reports: final test accuracy, time, throughput and where the files went."""

    test_accuracy: float
    epochs: int
    seconds: float
    samples_per_second: float
    checkpoint: str
    plot: Path | None
    history: History


def train(args: argparse.Namespace, strategy: Strategy) -> Result:
    """Trains (or resumes) the digits MLP on `strategy` as `args` say; writes a checkpoint every epoch."""
    start = time.perf_counter()
    xp = strategy.extended.backend.xp
    dtype = compute_dtype(args.precision, xp)
    x_train, y_train, x_test, y_test = load_digits()
    with strategy.scope():
        model = MLP(xp, x_train.shape[1], args.hidden, DIGITS_CLASSES, args.seed)
        optimizer = make_optimizer(args.optimizer, args.learning_rate, args.momentum)
        epoch = Variable(np.int64(0), trainable=False, name="epoch")
    checkpoint = Checkpoint(optimizer=optimizer, epoch=epoch, **model.variables)
    checkpoint_path, history_path = args.out / "ckpt", args.out / "history.json"
    history = History()
    if args.resume:
        checkpoint.restore(checkpoint_path)
        history = History.load(history_path, int(epoch.numpy()))
    args.out.mkdir(parents=True, exist_ok=True)

    def train_step(x, y):
        loss, grads = model.loss_and_gradients(x, y, dtype)
        optimizer.apply_gradients(list(zip(grads, model.variables.values())))
        return loss

    def count_correct(x, y):
        return (model.logits(x, dtype).argmax(axis=1) == y).sum()

    def evaluate() -> float:
        batches = strategy.experimental_distribute_dataset(test_batches(x_test, y_test, args.global_batch_size))
        correct = sum(int(strategy.reduce("SUM", strategy.run(count_correct, args=batch), axis=None))
                      for batch in batches)
        return correct / len(x_test)

    steps_per_epoch = len(x_train) // args.global_batch_size
    trained_samples, training_seconds = 0, 0.0
    saved = str(checkpoint_path)
    with progress_display() as progress:
        for epoch_index in range(int(epoch.numpy()), args.epochs):
            progress.start_epoch(epoch_index, args.epochs, steps_per_epoch)
            batches = epoch_batches(x_train, y_train, args.global_batch_size, args.seed, epoch_index)
            epoch_start, epoch_samples = time.perf_counter(), 0
            for batch in strategy.experimental_distribute_dataset(batches):
                loss = float(strategy.reduce("MEAN", strategy.run(train_step, args=batch), axis=None))
                history.step_loss.append(loss)
                epoch_samples += args.global_batch_size
                progress.step(loss, epoch_samples / (time.perf_counter() - epoch_start))
            training_seconds += time.perf_counter() - epoch_start
            trained_samples += epoch_samples
            history.end_epoch(evaluate())
            epoch.assign(np.int64(epoch_index + 1))
            history.save(history_path)  # before the checkpoint, so a crash between the two loses nothing
            saved = checkpoint.save(checkpoint_path)
            progress.end_epoch(history.test_accuracy[-1])

    accuracy = history.test_accuracy[-1] if history.test_accuracy else evaluate()
    plot = None
    if importlib.util.find_spec("matplotlib") is None:
        print("distrib train: matplotlib is not installed, so no loss-curve PNG (pip install 'distrib[train]').",
              file=sys.stderr)
    elif history.step_loss:
        plot = args.out / "loss.png"
        plot_history(history, plot)
    return Result(accuracy, int(epoch.numpy()), time.perf_counter() - start,
                  trained_samples / training_seconds if training_seconds else 0.0, saved, plot, history)


# -- the command line ------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distrib train", description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, help="emulated CPU replicas (default: every GPU with the CUDA "
                                                     "backend, else $DISTRIB_CPU_REPLICAS or 2)")
    parser.add_argument("--epochs", type=int, default=20,
                        help="total epochs, counting those a resumed checkpoint already ran (default 20)")
    parser.add_argument("--global-batch-size", type=int, default=64,
                        help="rows per step over all replicas; must divide evenly over them (default 64)")
    parser.add_argument("--learning-rate", type=float,
                        help=f"default {DEFAULT_LEARNING_RATES['adam']} for adam, {DEFAULT_LEARNING_RATES['sgd']} "
                             f"for sgd")
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--momentum", type=float, help="SGD momentum (default 0.9; sgd only)")
    parser.add_argument("--precision", choices=("float32", "float16", "bfloat16"), default="float32",
                        help="compute dtype of the forward and backward passes; weights stay float32")
    parser.add_argument("--hidden", type=int, default=128, help="hidden units (default 128)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the initial weights and the shuffling")
    parser.add_argument("--out", type=Path, default=Path("runs/digits"),
                        help="run directory: ckpt, history.json, loss.png (default runs/digits)")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    return parser


def check_flags(args: argparse.Namespace) -> None:
    """ValueError naming the flag, for flag values that cannot work whatever the devices."""
    for flag in ("replicas", "epochs", "global_batch_size", "hidden"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1. Received: {value}.")
    if args.optimizer == "adam" and args.momentum is not None:
        raise ValueError("--momentum applies to --optimizer sgd only.")
    if args.resume and not (args.out / "ckpt").exists():
        raise ValueError(f"--resume found no checkpoint at {args.out / 'ckpt'}: run without --resume first.")


def make_strategy(args: argparse.Namespace) -> Strategy:
    """The MirroredStrategy `--replicas` asks for; ValueError if the batch or precision cannot run on it."""
    devices = None if args.replicas is None else [f"CPU:{i}" for i in range(args.replicas)]
    strategy = MirroredStrategy(devices)
    replicas = strategy.num_replicas_in_sync
    if args.global_batch_size % replicas:
        raise ValueError(f"--global-batch-size must divide evenly over the {replicas} replicas, so that every "
                         f"replica's batch mean weighs rows equally. Received: {args.global_batch_size}.")
    compute_dtype(args.precision, strategy.extended.backend.xp)
    return strategy


def main(argv: list[str] | None = None) -> int:
    """Parses the flags, trains, and prints the test accuracy, wall time and throughput."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_flags(args)
        strategy = make_strategy(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.learning_rate is None:
        args.learning_rate = DEFAULT_LEARNING_RATES[args.optimizer]
    if args.optimizer == "sgd" and args.momentum is None:
        args.momentum = 0.9
    print(f"{strategy!r}: {strategy.num_replicas_in_sync} replicas, global batch {args.global_batch_size}, "
          f"{args.optimizer} lr {args.learning_rate}, {args.precision}")
    result = train(args, strategy)
    print(f"test accuracy {result.test_accuracy:.2%} after {result.epochs} epochs; {result.seconds:.1f} s, "
          f"{result.samples_per_second:,.0f} samples/s")
    print(f"checkpoint {result.checkpoint}" + (f", loss curve {result.plot}" if result.plot else ""))
    return 0
