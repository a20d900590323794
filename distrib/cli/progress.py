"""What a training run shows and leaves behind: progress lines or bars, the history JSON and the loss curve."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from distrib.install_hint import pip_install


@dataclass
class History:
    """Per-step training loss and per-epoch test accuracy; saved beside the checkpoint as JSON."""

    step_loss: list[float] = field(default_factory=list)
    epoch_end_step: list[int] = field(default_factory=list)
    test_accuracy: list[float] = field(default_factory=list)
    # the epochs run before the curve starts: a history restarted on a resume (its file was damaged) starts at the
    # checkpoint's, so that the next resume finds it whole instead of short and restarts it again
    first_epoch: int = 0

    def end_epoch(self, test_accuracy: float) -> None:
        self.epoch_end_step.append(len(self.step_loss))
        self.test_accuracy.append(test_accuracy)

    def save(self, path: Path) -> None:
        """Writes atomically: a crash leaves the previous file, and a failed write (a full disk) no partial one."""
        partial = path.with_name(path.name + ".partial")
        try:
            partial.write_text(json.dumps(asdict(self)))
            os.replace(partial, path)
        except BaseException:
            with contextlib.suppress(OSError):
                partial.unlink()
            raise

    @classmethod
    def load(cls, path: Path, epochs: int) -> "History":
        """The first `epochs` epochs of a saved history (a history may hold more epochs than the checkpoint beside
        it, from runs written before it came after the checkpoint, and fewer where a run was killed between the two)."""
        saved = cls(**json.loads(path.read_text())) if path.exists() else cls()
        kept = max(0, epochs - saved.first_epoch)  # of its own epochs
        steps = saved.epoch_end_step[kept - 1] if 0 < kept <= len(saved.epoch_end_step) else 0
        return cls(saved.step_loss[:steps], saved.epoch_end_step[:kept], saved.test_accuracy[:kept],
                   saved.first_epoch)

    @property
    def last_epoch(self) -> int:
        """The epochs of the run this history reaches to (its first epoch's predecessors included)."""
        return self.first_epoch + len(self.test_accuracy)


class TrainingDiverged(ArithmeticError):
    """The training loss became NaN or infinite: every later step would only spread it through the weights."""


def check_finite(losses: list, first_step: int, epoch: int) -> None:
    """Raises TrainingDiverged naming the first step (1-based, counted over the whole run) whose loss is not finite."""
    for k, loss in enumerate(losses):
        if not math.isfinite(loss):
            raise TrainingDiverged(f"the training loss became {loss} at step {first_step + k} (epoch {epoch + 1}), "
                                   f"so training stopped (a lower --learning-rate usually avoids that).")


def read_scalars(backend, device: str, values: list) -> list:
    """Scalars on `device` as Python numbers, in one copy to the host (each read waits for the queued work)."""
    if not values:
        return []
    with backend.device_scope(device):
        return backend.to_host(backend.xp.stack(values)).tolist()


def plot_history(history: History, path: Path) -> None:
    """Writes the loss curve (per step) above the test accuracy (per epoch) as a PNG, with matplotlib's Agg."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 6), layout="constrained")
    FigureCanvasAgg(figure)
    loss_axes, accuracy_axes = figure.subplots(2, 1, sharex=True)
    loss_axes.plot(np.arange(1, len(history.step_loss) + 1), history.step_loss, linewidth=0.8)
    loss_axes.set(yscale="log", ylabel="training loss (global batch mean)", title="distrib train: digits MLP")
    loss_axes.grid(alpha=0.3)
    accuracy_axes.plot(history.epoch_end_step, np.multiply(history.test_accuracy, 100), marker="o")
    accuracy_axes.set(xlabel="step", ylabel="test accuracy (%)")
    accuracy_axes.grid(alpha=0.3)
    figure.savefig(path, dpi=100)


# -- progress ------------------------------------------------------------------------------------------

class PlainProgress:
    """One line per epoch, for logs and terminals without rich."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        pass

    def start_epoch(self, epoch: int, epochs: int, steps: int) -> None:
        self._label = f"epoch {epoch + 1}/{epochs}"
        self._loss, self._rate = float("nan"), 0.0  # an epoch of no steps still ends with a line

    def step(self, loss: float, samples_per_second: float, steps: int = 1) -> None:
        """`steps` more steps done, the last with `loss`."""
        self._loss, self._rate = loss, samples_per_second

    def end_epoch(self, test_accuracy: float) -> None:
        print(f"{self._label}  loss {self._loss:.4f}  test accuracy {test_accuracy:.2%}  "
              f"{self._rate:,.0f} samples/s", flush=True)


class RichProgress(PlainProgress):
    """A live bar for the current epoch with its loss and throughput; a finished epoch stays as a still line."""

    def __init__(self):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        self._bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                              TextColumn("loss {task.fields[loss]:.4f}"),
                              TextColumn("{task.fields[rate]:>7,.0f} samples/s"), TimeElapsedColumn(),
                              TextColumn("{task.fields[accuracy]}"))

    def __enter__(self):
        self._bars.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        self._bars.__exit__(*exc_info)

    def start_epoch(self, epoch: int, epochs: int, steps: int) -> None:
        label = f"epoch {epoch + 1:>{len(str(epochs))}}/{epochs}"  # padded, so that the still lines align
        self._task = self._bars.add_task(label, total=steps, loss=float("nan"), rate=0.0, accuracy="")

    def step(self, loss: float, samples_per_second: float, steps: int = 1) -> None:
        self._bars.update(self._task, advance=steps, loss=loss, rate=samples_per_second)

    def end_epoch(self, test_accuracy: float) -> None:
        """Prints the finished bar above the live one and drops it: only one bar is redrawn, however many epochs."""
        self._bars.update(self._task, accuracy=f"test accuracy {test_accuracy:.2%}")
        (task,) = (task for task in self._bars.tasks if task.id == self._task)
        self._bars.console.print(self._bars.make_tasks_table([task]))
        self._bars.remove_task(self._task)


class SilentProgress(PlainProgress):
    """Nothing at all: the non-chief processes of a multi-worker job leave the display to the chief."""

    def end_epoch(self, test_accuracy: float) -> None:
        pass


def progress_display(quiet: bool = False, plain: bool = False) -> PlainProgress:
    """Rich bars on a terminal, else plain lines; says once when rich is missing; nothing when `quiet`.

    `plain` asks for plain lines even on a terminal: an MPI launcher gives its ranks a pseudo-terminal whatever
    its own output is, where a live bar's redraws (how many depends on timing) would fill the job's log.
    """
    if quiet:
        return SilentProgress()
    if importlib.util.find_spec("rich") is None:
        print(f"distrib train: rich is not installed, so no progress bar ({pip_install('train')}).",
              file=sys.stderr)
        return PlainProgress()
    return RichProgress() if sys.stdout.isatty() and not plain else PlainProgress()
