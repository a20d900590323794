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
import contextlib
import importlib.util
import math
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from distrib.checkpoint import Checkpoint
from distrib.cli.model import MLP
from distrib.cli.progress import (History, TrainingDiverged, check_finite, plot_history, progress_display,
                                   read_scalars)
from distrib.cli.train_strategy import compute_dtype, make_strategy, replicas_at_once, shared_cores
from distrib.datasets import DIGITS_CLASSES, load_digits
from distrib.errors import BackendUnavailableError, CheckpointError, WorkerFailedError
from distrib.install_hint import pip_install
from distrib.mpi_env import mpi_environment
from distrib.optimizers import SGD, Adam
from distrib.strategy import Strategy
from distrib.variables import Variable

DEFAULT_LEARNING_RATES = {"adam": 0.003, "sgd": 0.05}
RUN_FILES = ("ckpt", "history.json", "loss.png")  # what a run leaves in --out
REFRESH_SECONDS = 0.2  # the step losses kept on the device are read and shown this often, and at each epoch's end

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
    first_device = strategy.extended.worker_devices[0]
    dtype = compute_dtype(args.precision, xp)
    x_train, y_train, x_test, y_test = load_digits()
    with strategy.scope():
        model = MLP(xp, x_train.shape[1], args.hidden, DIGITS_CLASSES, args.seed)
        optimizer = make_optimizer(args.optimizer, args.learning_rate, args.momentum)
        epoch = Variable(np.int64(0), trainable=False, name="epoch")
    # `run` (metadata) records what a resumed run must match: the model's shape and the optimizer's slots
    checkpoint = Checkpoint(optimizer=optimizer, epoch=epoch, run=run_signature(args), **model.variables)
    checkpoint_path, history_path = args.out / "ckpt", args.out / "history.json"
    chief = strategy.extended.should_checkpoint  # in a multi-worker job, rank 0 alone shows and writes
    history = History()
    if args.resume:
        checkpoint.restore(checkpoint_path)
        history = load_history(history_path, int(epoch.numpy()))

    def train_step(x, y):
        loss, grads = model.loss_and_gradients(x, y, dtype)
        optimizer.apply_gradients(list(zip(grads, model.variables.values())))
        return loss

    def count_correct(x, y):
        return (model.logits(x, dtype).argmax(axis=1) == y).sum()

    def evaluate() -> float:
        batches = strategy.experimental_distribute_dataset(test_batches(x_test, y_test, args.global_batch_size))
        counts = [on_device("SUM", strategy.run(count_correct, args=batch)) for batch in batches]
        return sum(int(n) for n in read_scalars(strategy.extended.backend, first_device, counts)) / len(x_test)

    def on_device(op: str, per_replica):
        """`per_replica` reduced across replicas onto the first local device: reading it would wait for the step."""
        return strategy.experimental_local_results(strategy.extended.reduce_to(op, per_replica, first_device))[0]

    steps_per_epoch = len(x_train) // args.global_batch_size
    trained_samples, training_seconds = 0, 0.0
    saved = str(checkpoint_path)
    with progress_display(quiet=not chief, plain=mpi_environment() is not None) as progress:
        for epoch_index in range(int(epoch.numpy()), args.epochs):
            progress.start_epoch(epoch_index, args.epochs, steps_per_epoch)
            batches = epoch_batches(x_train, y_train, args.global_batch_size, args.seed, epoch_index)
            epoch_start, epoch_samples = time.perf_counter(), 0
            pending, shown = [], epoch_start  # losses still on the device; when the progress was last refreshed

            def show_pending() -> None:  # one read for many steps, so the device runs ahead of the host meanwhile
                losses = read_scalars(strategy.extended.backend, first_device, pending)
                check_finite(losses, len(history.step_loss) + 1, epoch_index)  # before a NaN epoch is checkpointed
                history.step_loss.extend(losses)
                pending.clear()
                if losses:
                    progress.step(losses[-1], epoch_samples / (time.perf_counter() - epoch_start), len(losses))

            for batch in strategy.experimental_distribute_dataset(batches):
                pending.append(on_device("MEAN", strategy.run(train_step, args=batch)))
                epoch_samples += args.global_batch_size
                if time.perf_counter() - shown >= REFRESH_SECONDS:
                    show_pending()
                    shown = time.perf_counter()
            show_pending()
            training_seconds += time.perf_counter() - epoch_start
            trained_samples += epoch_samples
            history.end_epoch(evaluate())
            epoch.assign(np.int64(epoch_index + 1))
            if chief:
                history.save(history_path)  # before the checkpoint, so a crash between the two loses nothing
            saved = checkpoint.save(checkpoint_path)
            progress.end_epoch(history.test_accuracy[-1])

    accuracy = history.test_accuracy[-1] if history.test_accuracy else evaluate()
    plot = None
    if chief and importlib.util.find_spec("matplotlib") is None:
        print(f"distrib train: matplotlib is not installed, so no loss-curve PNG ({pip_install('train')}).",
              file=sys.stderr)
    elif chief and history.step_loss:
        plot = args.out / "loss.png"
        plot_history(history, plot)
    return Result(accuracy, int(epoch.numpy()), time.perf_counter() - start,
                  trained_samples / training_seconds if training_seconds else 0.0, saved, plot, history)


# -- the command line ------------------------------------------------------------------------------------

class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line, `prog: error: message`, exit status 2 (the usage is under --help)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="distrib train", description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, help="replicas: N GPUs with the CUDA backend (N replicas over the "
                                                     "GPUs there are if fewer), else N emulated CPU devices "
                                                     "(default: every GPU, else $DISTRIB_CPU_REPLICAS or 2)")
    parser.add_argument("--epochs", type=int, default=20,
                        help="total epochs, counting those a resumed checkpoint already ran (default 20)")
    parser.add_argument("--global-batch-size", type=int, default=64,
                        help="rows per step over all replicas; must divide evenly over them (default 64)")
    parser.add_argument("--learning-rate", type=float,
                        help=f"default {DEFAULT_LEARNING_RATES['adam']} for adam, {DEFAULT_LEARNING_RATES['sgd']} "
                             f"for sgd")
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="default adam")
    parser.add_argument("--momentum", type=float, help="SGD momentum (default 0.9; sgd only)")
    parser.add_argument("--precision", choices=("float32", "float16", "bfloat16"), default="float32",
                        help="dtype of the forward and backward passes (default float32); weights stay float32")
    parser.add_argument("--hidden", type=int, default=128, help="hidden units (default 128)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the initial weights and the shuffling (default 0)")
    parser.add_argument("--out", type=Path, default=Path("runs/digits"),
                        help="run directory: ckpt, history.json, loss.png (default runs/digits)")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    parser.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    return parser


def check_flags(args: argparse.Namespace) -> None:
    """ValueError naming the flag, for flag values that cannot work whatever the devices."""
    for flag in ("replicas", "epochs", "global_batch_size", "hidden"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1. Received: {value}.")
    training_rows = len(load_digits()[0])
    if args.global_batch_size > training_rows:
        raise ValueError(f"--global-batch-size must be at most the {training_rows} training rows, or no step "
                         f"runs. Received: {args.global_batch_size}.")
    if args.learning_rate is not None and not (math.isfinite(args.learning_rate) and args.learning_rate >= 0):
        raise ValueError(f"--learning-rate must be a finite number of at least 0. Received: {args.learning_rate}.")
    if args.optimizer == "adam" and args.momentum is not None:
        raise ValueError("--momentum applies to --optimizer sgd only.")
    if args.momentum is not None and not 0 <= args.momentum <= 1:
        raise ValueError(f"--momentum must be in [0, 1]. Received: {args.momentum}.")
    if args.seed < 0:
        raise ValueError(f"--seed must be at least 0. Received: {args.seed}.")
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the run in --out and --overwrite replaces it: pass one of them.")
    if args.resume and not (args.out / "ckpt").exists():
        raise ValueError(f"--resume found no checkpoint at {args.out / 'ckpt'}: run without --resume first.")


def run_signature(args: argparse.Namespace) -> dict:
    """The flags a checkpoint fixes: a resumed run must have the same model shape and optimizer slots."""
    return {"hidden": args.hidden, "optimizer": args.optimizer}


def check_resume(args: argparse.Namespace) -> None:
    """ValueError (CheckpointError for a damaged file) unless the checkpoint in --out fits these flags."""
    saved = Checkpoint(run={}).restore(args.out / "ckpt", allow_partial=True)["run"]
    for flag, value in run_signature(args).items():
        if flag in saved and saved[flag] != value:
            raise ValueError(f"--resume needs the --{flag} the checkpoint was trained with: --{flag} {saved[flag]}. "
                             f"Received: --{flag} {value}.")


def prepare_out(args: argparse.Namespace) -> None:
    """Creates --out and checks it is writable; refuses to replace a run in it without --resume or --overwrite."""
    out = args.out
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out must be a directory. Received: {str(out)!r}, which is a file.")
    present = [name for name in RUN_FILES if (out / name).exists()]
    if present and not (args.resume or args.overwrite):
        raise ValueError(f"--out already holds a run ({', '.join(present)}): pass --resume to continue it or "
                         f"--overwrite to replace it. Received: {str(out)!r}.")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise ValueError(f"--out must be a directory distrib train can create and write to. Received: "
                         f"{str(out)!r} ({exc.strerror or exc}).") from None
    if args.overwrite:
        for name in present:
            (out / name).unlink(missing_ok=True)  # another process of the job may have removed it first


def load_history(path: Path, epochs: int) -> History:
    """The saved history's first `epochs` epochs; an empty one, with a warning, when the file is damaged.

    The history only draws the loss curve: a truncated file must not stop a resume whose checkpoint is fine.
    """
    try:
        return History.load(path, epochs)
    except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError; wrong fields a TypeError
        print(f"distrib train: {path} is damaged ({exc}); resuming from the checkpoint, with the loss curve "
              f"restarting at epoch {epochs + 1}.", file=sys.stderr)
        return History()


def stopped(args: argparse.Namespace, argv: list[str], why: str) -> None:
    """Says why the run stopped, where the last checkpoint is and the command that resumes from it (under mpirun,
    an mpirun command: Ctrl-C reaches mpirun, which ends every rank with SIGTERM)."""
    checkpoint = args.out / "ckpt"
    if checkpoint.exists():
        flags = [a for a in argv if a not in ("--resume", "--overwrite")]
        launched = mpi_environment()
        mpirun = ["mpirun", "-np", str(launched[2])] if launched is not None and launched[2] > 1 else []
        then = f"The last checkpoint is {checkpoint}; resume with: " \
               f"{shlex.join([*mpirun, 'distrib', 'train', *flags, '--resume'])}"
    else:
        then = "This was before the first checkpoint (written after each epoch): nothing to resume."
    sys.stderr.write(f"\ndistrib train: {why} {then}\n")  # one write: under mpirun, other ranks' lines go between


def main(argv: list[str] | None = None) -> int:
    """Parses the flags, trains, and prints the test accuracy, wall time and throughput."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_flags(args)
        strategy = make_strategy(args)
        if args.resume:
            check_resume(args)
        prepare_out(args)
    except (ValueError, BackendUnavailableError) as exc:
        parser.error(f"--resume: {exc}" if isinstance(exc, CheckpointError) else str(exc))
    if args.learning_rate is None:
        args.learning_rate = DEFAULT_LEARNING_RATES[args.optimizer]
    if args.optimizer == "sgd" and args.momentum is None:
        args.momentum = 0.9
    chief = strategy.extended.should_checkpoint  # under mpirun, rank 0 alone reports
    if chief:
        print(f"{strategy!r}: {strategy.num_replicas_in_sync} replicas, global batch {args.global_batch_size}, "
              f"{args.optimizer} lr {args.learning_rate}, {args.precision}")
    flags = sys.argv[1:] if argv is None else list(argv)

    def report_stop(exc: BaseException) -> None:  # rank 0 reports, or the others when it is the one that died
        if chief or 0 in getattr(exc, "ranks", ()):
            interrupted = isinstance(exc, KeyboardInterrupt)
            stopped(args, flags, "interrupted; the step in progress was abandoned." if interrupted else str(exc))

    group = getattr(strategy.extended.backend, "group", None)  # the processes of a multi-worker job
    if group is not None:  # a rank ended by its watchdog, inside an MPI call, reports through it
        group.last_words.append(report_stop)
    emulated = strategy.extended.backend.xp is np  # on GPUs the replicas' math is not the host's BLAS
    try:
        with shared_cores(replicas_at_once(strategy)) if emulated else contextlib.nullcontext():
            result = train(args, strategy)
    except CheckpointError as exc:  # a checkpoint that passed check_resume but does not fit the model
        if not args.resume:
            raise
        parser.error(f"--resume: {exc}")
    except TrainingDiverged as exc:  # the last checkpoint holds the last epoch whose losses were all finite
        if chief:
            stopped(args, flags, str(exc))
        return 1
    except (KeyboardInterrupt, WorkerFailedError) as exc:  # Ctrl-C; under mpirun (Ctrl-C or a failed rank) the latter
        report_stop(exc)  # the strategy abandoned the step whole either way
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        strategy.close()
    if chief:
        speed = f"{result.seconds:.1f} s, {result.samples_per_second:,.0f} samples/s" if result.samples_per_second \
            else "the checkpoint had run them all, so nothing was trained (raise --epochs to train more)"
        print(f"test accuracy {result.test_accuracy:.2%} after {result.epochs} epoch{'s' * (result.epochs != 1)}; "
              f"{speed}")
        print(f"checkpoint {result.checkpoint}" + (f", loss curve {result.plot}" if result.plot else ""))
    return 0
