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
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from distrib.backends.cpu import MAX_REPLICAS
from distrib.checkpoint import Checkpoint
from distrib.cli.model import MLP
from distrib.cli.progress import (History, TrainingDiverged, check_finite, plot_history, progress_display,
                                   read_scalars)
from distrib.cli.train_strategy import (AlikeOnEveryRank, compute_dtype, make_strategy, replicas_at_once,
                                        shared_cores)
from distrib.datasets import DIGITS_CLASSES, load_digits
from distrib.errors import BackendUnavailableError, CheckpointError, WorkerFailedError
from distrib.install_hint import pip_install
from distrib.interrupts import deferred_interrupts
from distrib.mpi_env import mpi_environment, reports_for_the_job
from distrib.optimizers import SGD, Adam
from distrib.strategy import Strategy
from distrib.variables import Variable

DEFAULT_LEARNING_RATES = {"adam": 0.003, "sgd": 0.05}
RUN_FILES = {"ckpt": "checkpoint", "history.json": "history", "loss.png": "loss curve"}  # what a run leaves in --out
FLOAT32_MAX = float(np.finfo(np.float32).max)  # the weights and the optimizer's arithmetic are float32
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
    plot_error: str | None = None  # why the loss curve could not be written (the run itself went well)


class RefusedFlag(Exception):
    """A flag the run found it cannot use once it started (`--hidden` too large to allocate): exit status 2."""


class RunFileError(Exception):
    """The checkpoint or the history could not be written during the run: exit status 1."""


def weights_bytes(hidden: int) -> int:
    """The bytes of one replica's float32 weights for `--hidden`."""
    features = load_digits()[0].shape[1]
    return 4 * (features * hidden + hidden + hidden * DIGITS_CLASSES + DIGITS_CLASSES)


def not_finite(strategy: Strategy, device: str, variables: list) -> list[str]:
    """The names of those of `variables` that hold a NaN or an infinity, read on `device` in one copy."""
    backend = strategy.extended.backend
    with backend.device_scope(device):
        finite = [backend.xp.isfinite(strategy.experimental_local_results(v)[0].read_value()).all()
                  for v in variables]
    return [v.name for v, ok in zip(variables, read_scalars(backend, device, finite)) if not ok]


def check_weights(strategy: Strategy, device: str, variables: list, step: int, epoch_index: int) -> None:
    """TrainingDiverged unless every one of `variables` (weights, optimizer state) is finite on `device`.

    The losses show a non-finite weight at the next step, except for the weights an epoch's last step writes:
    they would go into the checkpoint, and every resumed run would diverge at its first step.
    """
    bad = not_finite(strategy, device, variables)
    if bad:
        raise TrainingDiverged(f"the weights became nan or infinite by step {step} (epoch {epoch_index + 1}: "
                               f"{', '.join(bad)}), so training stopped (a lower --learning-rate usually avoids "
                               f"that).")


def train(args: argparse.Namespace, strategy: Strategy) -> Result:
    """Trains (or resumes) the digits MLP on `strategy` as `args` say; writes a checkpoint every epoch."""
    start = time.perf_counter()
    xp = strategy.extended.backend.xp
    first_device = strategy.extended.worker_devices[0]
    dtype = compute_dtype(args.precision, xp)
    x_train, y_train, x_test, y_test = load_digits()
    with strategy.scope():
        try:
            model = MLP(xp, x_train.shape[1], args.hidden, DIGITS_CLASSES, args.seed)
        except (MemoryError, ValueError, OverflowError) as exc:  # NumPy: MemoryError, or ValueError past 2**63 bytes
            kind = "MemoryError" if isinstance(exc, MemoryError) else type(exc).__name__
            raise RefusedFlag(f"--hidden must give weights that fit in memory: --hidden {args.hidden} needs "
                              f"{binary_size(weights_bytes(args.hidden))} for each replica's weights, more than "
                              f"could be allocated ({kind}). Received: {args.hidden}.") from None
        optimizer = make_optimizer(args.optimizer, args.learning_rate, args.momentum)
        epoch = Variable(np.int64(0), trainable=False, name="epoch")
    # `run` (metadata) records what a resumed run must match: the model's shape and the optimizer's slots
    checkpoint = Checkpoint(optimizer=optimizer, epoch=epoch, run=run_signature(args), **model.variables)
    checkpoint_path, history_path = args.out / "ckpt", args.out / "history.json"
    chief = strategy.extended.should_checkpoint  # in a multi-worker job, rank 0 alone shows and writes
    history = History()
    if args.resume:
        checkpoint.restore(checkpoint_path)
        checkpoint.metadata["run"] = run_signature(args)  # restore read the saved one: the next save records this run
        bad = not_finite(strategy, first_device, list(model.variables.values()))
        if bad:  # written before the weights were checked at each save: every step from it would diverge
            raise CheckpointError(f"Checkpoint {str(checkpoint_path)!r} holds nan or infinite weights "
                                  f"({', '.join(bad)}), from which every run diverges: start over with --overwrite "
                                  f"instead of --resume.")
        history = load_history(history_path, int(epoch.numpy()), warn=chief)

    def train_step(x, y):
        loss, grads = model.loss_and_gradients(x, y, dtype)
        optimizer.apply_gradients(list(zip(grads, model.variables.values())))
        return loss

    def count_correct(x, y):
        # weights near float32's limit overflow here first: the next step's loss stops the run in one line instead
        with np.errstate(over="ignore", invalid="ignore"):
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
            # every rank checks (their weights are the same), so that all of them stop before the save's barrier
            check_weights(strategy, first_device, [*model.variables.values(), *optimizer.variables()],
                          len(history.step_loss), epoch_index)
            training_seconds += time.perf_counter() - epoch_start
            trained_samples += epoch_samples
            history.end_epoch(evaluate())
            epoch.assign(np.int64(epoch_index + 1))
            try:
                saved = checkpoint.save(checkpoint_path)
            except OSError as exc:
                raise RunFileError(f"the checkpoint could not be written to {checkpoint_path} "
                                   f"({exc.strerror or exc}).") from exc
            if chief:  # after the checkpoint: a history.json never claims epochs that no checkpoint can continue
                try:
                    history.save(history_path)
                except OSError as exc:
                    raise RunFileError(f"the history could not be written to {history_path} "
                                       f"({exc.strerror or exc}); the checkpoint of epoch {epoch_index + 1} "
                                       f"was.") from exc
            progress.end_epoch(history.test_accuracy[-1])

    accuracy = history.test_accuracy[-1] if history.test_accuracy else evaluate()
    plot, plot_error = None, None
    if chief and importlib.util.find_spec("matplotlib") is None:
        print(f"distrib train: matplotlib is not installed, so no loss-curve PNG ({pip_install('train')}).",
              file=sys.stderr)
    elif chief and history.step_loss:
        plot = args.out / "loss.png"
        try:
            plot_history(history, plot)
        except OSError as exc:  # reported after the accuracy: the training and its checkpoint went well
            plot, plot_error = None, f"the loss curve could not be written to {plot} ({exc.strerror or exc})."
    return Result(accuracy, int(epoch.numpy()), time.perf_counter() - start,
                  trained_samples / training_seconds if training_seconds else 0.0, saved, plot, history, plot_error)


def binary_size(size: int) -> str:
    """`size` bytes as people read it: 512 MiB, 27 TiB."""
    units = ("bytes", "KiB", "MiB", "GiB", "TiB")
    power = 0
    while power < len(units) - 1 and size >= 1024 ** (power + 1):
        power += 1
    return f"{size / 1024 ** power:,.0f} {units[power]}"


# -- the command line ------------------------------------------------------------------------------------

class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line, `prog: error: message`, exit status 2 (the usage is under --help).

    While `alike_on_every_rank` (the flags themselves are refused, which every rank of an MPI job refuses alike),
    rank 0 alone prints the line under mpirun; a refusal that may be this rank's own (its host's files or devices)
    is printed by every rank that makes it."""

    alike_on_every_rank = True

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n" if reports_for_the_job() or not self.alike_on_every_rank
                  else None)


def run_directory(text: str) -> Path:
    """--out as a Path; an empty one is refused rather than read as the current folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path names no directory (pass . for the current one)")
    return Path(text)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="distrib train", description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, help="replicas: N GPUs with the CUDA backend (N replicas over the "
                                                     "GPUs there are if fewer), else N emulated CPU devices "
                                                     "(default: every GPU, else $DISTRIB_CPU_REPLICAS or 2); under "
                                                     "mpirun, N emulated replicas per process (mpirun -np 2 ... "
                                                     "--replicas 2: 4 in all); on GPUs under mpirun each process "
                                                     "drives its share of its host's GPUs, without --replicas")
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
    parser.add_argument("--out", type=run_directory, default=Path("runs/digits"),
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
    if args.replicas is not None and args.replicas > MAX_REPLICAS:  # checked before it builds a device per replica
        raise ValueError(f"--replicas must be at most {MAX_REPLICAS}: each replica is a thread of this process. "
                         f"Received: {args.replicas}.")
    training_rows = len(load_digits()[0])
    if args.global_batch_size > training_rows:
        raise ValueError(f"--global-batch-size must be at most the {training_rows} training rows, or no step "
                         f"runs. Received: {args.global_batch_size}.")
    if args.learning_rate is not None and not (math.isfinite(args.learning_rate) and args.learning_rate >= 0):
        raise ValueError(f"--learning-rate must be a finite number of at least 0. Received: {args.learning_rate}.")
    if args.learning_rate is not None and args.learning_rate > FLOAT32_MAX:  # compared as a Python float: no warning
        raise ValueError(f"--learning-rate must be finite in float32, the dtype of the weights and of the optimizer's "
                         f"arithmetic: at most {FLOAT32_MAX:.7g}. Received: {args.learning_rate}.")
    if args.optimizer == "adam" and args.momentum is not None:
        raise ValueError("--momentum applies to --optimizer sgd only.")
    if args.momentum is not None and not 0 <= args.momentum <= 1:
        raise ValueError(f"--momentum must be in [0, 1]. Received: {args.momentum}.")
    if args.seed < 0:
        raise ValueError(f"--seed must be at least 0. Received: {args.seed}.")
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the run in --out and --overwrite replaces it: pass one of them.")


def check_out(args: argparse.Namespace) -> None:
    """ValueError naming --out, for a run directory that --resume or a new run cannot use (this host's files)."""
    for name, role in RUN_FILES.items():  # what --resume reads and --overwrite removes must be files
        if (args.out / name).is_dir():
            raise ValueError(f"--out must not hold a folder named {name}, the name of a run's {role}: move or "
                             f"remove it. Received: {str(args.out / name)!r}, a folder.")
    checkpoint = args.out / "ckpt"
    if args.resume and not checkpoint.exists():
        others = [name for name in RUN_FILES if (args.out / name).exists()]
        if others:  # no run can continue from --out: plain `distrib train` would refuse it too
            raise ValueError(f"--resume found no checkpoint at {checkpoint}, only {', '.join(others)}: start over "
                             f"with --overwrite instead of --resume.")
        raise ValueError(f"--resume found no checkpoint at {checkpoint}: run without --resume first.")


def apply_defaults(args: argparse.Namespace) -> None:
    """Fills in the flags whose default depends on --optimizer (after check_flags, which tells them apart)."""
    if args.learning_rate is None:
        args.learning_rate = DEFAULT_LEARNING_RATES[args.optimizer]
    if args.optimizer == "sgd" and args.momentum is None:
        args.momentum = 0.9


def run_signature(args: argparse.Namespace) -> dict:
    """The flags a checkpoint fixes: a resumed run must have the same model shape and optimizer slots (SGD keeps a
    momentum slot per weight unless --momentum is 0)."""
    signature = {"hidden": args.hidden, "optimizer": args.optimizer}
    if args.optimizer == "sgd":
        signature["momentum"] = args.momentum
    return signature


def check_resume(args: argparse.Namespace) -> None:
    """ValueError (CheckpointError for a damaged file) unless the checkpoint in --out fits these flags."""
    path = args.out / "ckpt"
    try:
        saved = Checkpoint(run={}).restore(path, allow_partial=True)["run"]
    except OSError as exc:
        raise ValueError(f"--resume could not read the checkpoint {path} ({exc.strerror or exc}).") from None
    for flag, value in run_signature(args).items():
        if flag not in saved or saved[flag] == value:
            continue
        if flag != "momentum":
            raise ValueError(f"--resume needs the --{flag} the checkpoint was trained with: --{flag} {saved[flag]}. "
                             f"Received: --{flag} {value}.")
        # another momentum continues from the saved one (none, when it was 0); only 0 would drop a saved momentum
        if saved[flag] and not value:
            raise ValueError(f"--resume needs a --momentum above 0: the checkpoint was trained with --momentum "
                             f"{saved[flag]} and holds each weight's momentum, which --momentum {value} would "
                             f"drop. Received: --momentum {value}.")


def resume_problem(exc: CheckpointError) -> str:
    """The one line for a checkpoint --resume cannot use. The library's advice for a damaged file, to restore an
    earlier checkpoint, is not for distrib train: it keeps only the last one."""
    return "--resume: " + str(exc).replace(
        "Restore an earlier checkpoint.",
        "distrib train keeps only the last checkpoint: start over with --overwrite instead of --resume.")


def prepare_out(args: argparse.Namespace, chief: bool = True) -> None:
    """Creates --out and checks it is writable; refuses to replace a run in it without --resume or --overwrite;
    the `chief` (the one process, or rank 0) holds it for the run, refusing it while another run holds it."""
    out = args.out
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out must be a directory. Received: {str(out)!r}, which is a file.")
    present = [name for name in RUN_FILES if (out / name).exists()]
    if present and not (args.resume or args.overwrite):
        if "ckpt" not in present:  # history.json or loss.png alone: nothing that --resume could continue
            raise ValueError(f"--out holds a run's {', '.join(present)} but no checkpoint to resume from: pass "
                             f"--overwrite to start over. Received: {str(out)!r}.")
        raise ValueError(f"--out already holds a run ({', '.join(present)}): pass --resume to continue it or "
                         f"--overwrite to replace it. Received: {str(out)!r}.")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise ValueError(f"--out must be a directory distrib train can create and write to. Received: "
                         f"{str(out)!r} ({exc.strerror or exc}).") from None
    if chief:
        hold_run_directory(out)
    if args.overwrite:
        for name in present:
            try:
                (out / name).unlink(missing_ok=True)  # another process of the job may have removed it first
            except OSError as exc:
                raise ValueError(f"--overwrite could not remove {out / name} ({exc.strerror or exc}).") from None


_HELD: list[int] = []  # descriptors of the run directories this process holds, until its run ends


def hold_run_directory(out: Path) -> None:
    """Locks `out` (flock on the directory itself: no file added to the run) until `release_run_directories`, so
    that two runs into one --out, whose checkpoints and histories would interleave, cannot both start.

    Raises:
      ValueError: another process holds it.
    """
    try:
        import fcntl
    except ImportError:  # not on POSIX: no lock, as before
        return
    descriptor = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise ValueError(f"--out is in use by another distrib train run: wait for it to end, or pass another --out. "
                         f"Received: {str(out)!r}.") from None
    except OSError:  # a file system without locks: run unlocked
        os.close(descriptor)
        return
    _HELD.append(descriptor)


def release_run_directories() -> None:
    """Lets go of the run directories this process holds (its run ended)."""
    while _HELD:
        os.close(_HELD.pop())


def load_history(path: Path, epochs: int, warn: bool = True) -> History:
    """The saved history's first `epochs` epochs; an empty one, with a warning, when the file is damaged, missing
    or short of epochs (the history is written after the checkpoint: a run killed between the two leaves it so).

    The history only draws the loss curve: a truncated file must not stop a resume whose checkpoint is fine.
    """
    try:
        history = History.load(path, epochs)
    except (ValueError, TypeError, OSError) as exc:  # json.JSONDecodeError is a ValueError; wrong fields a TypeError
        problem = f"is damaged ({exc})"
    else:
        if history.last_epoch == epochs:  # `load` keeps none of a history that starts past the checkpoint
            return history
        problem = (f"holds {history.last_epoch} of the checkpoint's {epochs} epochs" if path.exists()
                   else "is missing")
    if warn:
        print(f"distrib train: {path} {problem}; resuming from the checkpoint, with the loss curve restarting at "
              f"epoch {epochs + 1}.", file=sys.stderr)
    return History(first_epoch=epochs)


def stopped(args: argparse.Namespace, argv: list[str], why: str) -> None:
    """Says why the run stopped, where the last checkpoint is and the command that resumes from it.

    Under mpirun (Ctrl-C reaches mpirun, which ends every rank with SIGTERM) the ranks cannot see mpirun's own
    options (--oversubscribe, -x ...), which the job may need: the line asks for the same mpirun command.
    """
    checkpoint = args.out / "ckpt"
    if checkpoint.exists():
        flags = [a for a in argv if a not in ("--resume", "--overwrite")]
        command = shlex.join(["distrib", "train", *flags, "--resume"])
        launched = mpi_environment()
        if launched is not None and launched[2] > 1:
            then = f"The last checkpoint is {checkpoint}; resume with the same mpirun command (its options, any " \
                   f"-np) ending in: {command}"
        else:
            then = f"The last checkpoint is {checkpoint}; resume with: {command}"
    else:
        then = "This was before the first checkpoint (written after each epoch): nothing to resume."
    sys.stderr.write(f"\ndistrib train: {why} {then}\n")  # one write: under mpirun, other ranks' lines go between


@contextlib.contextmanager
def terminate_as_interrupt():
    """Inside the block, SIGTERM (timeout, Slurm, docker stop) stops the run as Ctrl-C does; yields a list that
    holds the signal once one came. The previous handler is back when the block ends.

    It is a KeyboardInterrupt, so the strategy abandons the step whole; inside a block that must run whole
    (`deferred_interrupts`) it is held as a Ctrl-C would be, and raised as the block ends. A second SIGTERM ends
    the process at once. Only where SIGTERM is the default's (under mpirun the process group has its own handler)
    and in the main thread, which alone receives signals.
    """
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield received
        return

    def on_terminate(signum, frame) -> None:
        received.append(signum)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        deferral = deferred_interrupts()
        if deferral.depth:
            deferral.hold(signal.SIGINT, frame)  # the block's end delivers it to the SIGINT handler: KeyboardInterrupt
        else:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_terminate)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    """Parses the flags, trains, and prints the test accuracy, wall time and throughput."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_flags(args)
    except ValueError as exc:
        parser.error(str(exc))
    parser.alike_on_every_rank = False  # from here on, what is refused may be this rank's own: its host's files
    try:
        check_out(args)
        apply_defaults(args)
        strategy = make_strategy(args)
        if args.resume:
            check_resume(args)
        prepare_out(args, strategy.extended.should_checkpoint)
    except (ValueError, BackendUnavailableError) as exc:
        release_run_directories()  # prepare_out may refuse --overwrite after taking --out
        parser.alike_on_every_rank = isinstance(exc, AlikeOnEveryRank)
        parser.error(resume_problem(exc) if isinstance(exc, CheckpointError) else str(exc))
    except KeyboardInterrupt:  # Ctrl-C while the devices are found (CuPy's import takes a while): one line
        release_run_directories()
        sys.stderr.write("\ndistrib train: interrupted before training started; nothing was trained.\n")
        return 130
    chief = strategy.extended.should_checkpoint  # under mpirun, rank 0 alone reports
    if chief:
        print(f"{strategy!r}: {strategy.num_replicas_in_sync} replicas, global batch {args.global_batch_size}, "
              f"{args.optimizer} lr {args.learning_rate}, {args.precision}")
    flags = sys.argv[1:] if argv is None else list(argv)

    terminated: list[int] = []  # SIGTERM's number once it came (the single-process path)

    def report_stop(exc: BaseException) -> None:  # rank 0 reports, or the others when it is the one that died
        if chief or 0 in getattr(exc, "ranks", ()):
            if terminated:
                why = "terminated (SIGTERM); the step in progress was abandoned."
            elif isinstance(exc, KeyboardInterrupt):
                why = "interrupted; the step in progress was abandoned."
            else:
                why = str(exc)
            stopped(args, flags, why)

    group = getattr(strategy.extended.backend, "group", None)  # the processes of a multi-worker job
    if group is not None:  # a rank ended by its watchdog, inside an MPI call, reports through it
        group.last_words.append(report_stop)
    emulated = strategy.extended.backend.xp is np  # on GPUs the replicas' math is not the host's BLAS
    # under mpirun, SIGTERM is the process group's (mpirun ending the job): a WorkerFailedError
    terminating: contextlib.AbstractContextManager[list[int]] = \
        terminate_as_interrupt() if group is None else contextlib.nullcontext(terminated)
    try:
        with terminating as terminated, \
                shared_cores(replicas_at_once(strategy)) if emulated else contextlib.nullcontext():
            result = train(args, strategy)
    except RefusedFlag as exc:
        parser.error(str(exc))
    except CheckpointError as exc:  # a checkpoint that passed check_resume but does not fit the model
        if not args.resume:
            raise
        parser.error(resume_problem(exc))
    except (TrainingDiverged, RunFileError) as exc:  # the last checkpoint stays: finite, and written whole
        if chief:
            stopped(args, flags, str(exc))
        return 1
    except MemoryError as exc:  # this process's own failure: every rank says it
        stopped(args, flags, f"out of memory ({str(exc) or 'MemoryError'}); a smaller --hidden or --global-batch-size "
                             f"needs less.")
        return 1
    except (KeyboardInterrupt, WorkerFailedError) as exc:  # Ctrl-C; under mpirun (Ctrl-C or a failed rank) the latter
        report_stop(exc)  # the strategy abandoned the step whole either way
        if terminated:
            return 128 + int(signal.SIGTERM)
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        strategy.close()
        release_run_directories()
    if chief:
        speed = f"{result.seconds:.1f} s, {result.samples_per_second:,.0f} samples/s" if result.samples_per_second \
            else "the checkpoint had run them all, so nothing was trained (raise --epochs to train more)"
        print(f"test accuracy {result.test_accuracy:.2%} after {result.epochs} epoch{'s' * (result.epochs != 1)}; "
              f"{speed}")
        print(f"checkpoint {result.checkpoint}" + (f", loss curve {result.plot}" if result.plot else ""))
        if result.plot_error:  # after the accuracy lines, which it must not cost
            sys.stderr.write(f"distrib train: {result.plot_error}\n")
            return 1
    return 0
