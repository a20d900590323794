"""Learning-rate schedules, Keras's formulas: `distrib.optimizers.schedules`.

A schedule is any callable that takes the step (the optimizer's `iterations` before the update, a Python int,
as Keras's `LearningRateSchedule.__call__(step)`) and returns the learning rate as a number. The optimizer calls
it once per step, on the host, in its merge: every replica and device uses the same value. A schedule is code,
not state: checkpoints save `iterations`, from which it recomputes the rate.

Example:
  >>> from distrib.optimizers import schedules
  >>> decay = schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
  >>> round(decay(0), 6), round(decay(10), 6), round(decay(15), 6)
  (0.1, 0.05, 0.035355)
  >>> schedules.PiecewiseConstantDecay([100, 200], [1.0, 0.5, 0.1])(100)
  1.0
  >>> round(schedules.CosineDecay(1.0, decay_steps=100, alpha=0.1)(50), 6)
  0.55
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

__all__ = ["CosineDecay", "ExponentialDecay", "LearningRateSchedule", "PiecewiseConstantDecay"]


def _number(value: Any, argument: str, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{argument} must be a finite number. Received: {value!r}.")
    if positive and not value > 0:
        raise ValueError(f"{argument} must be > 0. Received: {value}.")
    return value


def _step(step: Any) -> float:
    try:
        return float(step)
    except (TypeError, ValueError):  # a distrib variable (iterations) reads as its value
        return float(step.numpy())


class LearningRateSchedule:
    """The base of the schedules: `__call__(step)` returns the learning rate at `step` (a Python float)."""

    def __call__(self, step: int) -> float:
        raise NotImplementedError("A learning rate schedule must override __call__.")

    def get_config(self) -> dict:
        raise NotImplementedError

    @classmethod
    def from_config(cls, config: dict) -> "LearningRateSchedule":
        return cls(**config)

    def __repr__(self) -> str:
        arguments = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({arguments})"


class ExponentialDecay(LearningRateSchedule):
    """`initial_learning_rate * decay_rate ** (step / decay_steps)`; with `staircase`, `step // decay_steps`
    (Keras's `floor(step / decay_steps)`).

    Args:
      initial_learning_rate: the rate at step 0.
      decay_steps: > 0.
      decay_rate: the factor per `decay_steps` steps.
      staircase: whether the exponent is an integer (the rate changes every `decay_steps` steps).
    """

    def __init__(self, initial_learning_rate: float, decay_steps: float, decay_rate: float, staircase: bool = False):
        self.initial_learning_rate = _number(initial_learning_rate, "initial_learning_rate")
        self.decay_steps = _number(decay_steps, "decay_steps", positive=True)
        self.decay_rate = _number(decay_rate, "decay_rate")
        self.staircase = bool(staircase)

    def __call__(self, step: int) -> float:
        p = _step(step) / self.decay_steps
        if self.staircase:
            p = math.floor(p)
        return self.initial_learning_rate * self.decay_rate ** p

    def get_config(self) -> dict:
        return {"initial_learning_rate": self.initial_learning_rate, "decay_steps": self.decay_steps,
                "decay_rate": self.decay_rate, "staircase": self.staircase}


class PiecewiseConstantDecay(LearningRateSchedule):
    """`values[0]` while `step <= boundaries[0]`, `values[i]` while `boundaries[i-1] < step <= boundaries[i]`,
    and `values[-1]` once `step > boundaries[-1]` (Keras's intervals: closed on the right).

    Args:
      boundaries: increasing steps.
      values: the rates, one more than `boundaries`.
    """

    def __init__(self, boundaries: Sequence[float], values: Sequence[float]):
        boundaries, values = list(boundaries), list(values)
        if len(boundaries) != len(values) - 1:
            raise ValueError(f"The length of boundaries should be 1 less than the length of values. Received: "
                             f"boundaries={boundaries} of length {len(boundaries)}, and values={values} of length "
                             f"{len(values)}.")
        for k, b in enumerate(boundaries):
            _number(b, f"boundaries[{k}]")
        for k, v in enumerate(values):
            _number(v, f"values[{k}]")
        if any(a >= b for a, b in zip(boundaries, boundaries[1:])):
            raise ValueError(f"boundaries must be strictly increasing. Received: {boundaries}.")
        self.boundaries, self.values = boundaries, values

    def __call__(self, step: int) -> float:
        step = _step(step)
        for boundary, value in zip(self.boundaries, self.values):
            if step <= boundary:
                return value
        return self.values[-1]

    def get_config(self) -> dict:
        return {"boundaries": self.boundaries, "values": self.values}


class CosineDecay(LearningRateSchedule):
    """`initial_learning_rate * ((1 - alpha) * 0.5 * (1 + cos(pi * min(step, decay_steps) / decay_steps))
    + alpha)`: from `initial_learning_rate` down to `alpha * initial_learning_rate` at `decay_steps`, then
    constant (Keras's CosineDecay without warmup).

    Args:
      initial_learning_rate: the rate at step 0.
      decay_steps: > 0, the steps to decay over.
      alpha: the final rate as a fraction of `initial_learning_rate`.
    """

    def __init__(self, initial_learning_rate: float, decay_steps: float, alpha: float = 0.0):
        self.initial_learning_rate = _number(initial_learning_rate, "initial_learning_rate")
        self.decay_steps = _number(decay_steps, "decay_steps", positive=True)
        self.alpha = _number(alpha, "alpha")

    def __call__(self, step: int) -> float:
        completed_fraction = min(_step(step), self.decay_steps) / self.decay_steps
        cosine_decayed = 0.5 * (1.0 + math.cos(math.pi * completed_fraction))
        return self.initial_learning_rate * ((1 - self.alpha) * cosine_decayed + self.alpha)

    def get_config(self) -> dict:
        return {"initial_learning_rate": self.initial_learning_rate, "decay_steps": self.decay_steps,
                "alpha": self.alpha}
