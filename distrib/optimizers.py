"""Optimizers that average the replicas' gradients and update every copy of a mirrored variable: SGD and Adam."""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import re
import sys
import warnings
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from distrib import context
from distrib.backends.cpu import to_numpy
from distrib import optimizers_schedules as schedules
from distrib.checkpoint import restore_deferred
from distrib.distributed_variables import DistributedVariable, MirroredVariable
from distrib.gradients import (check_gradient_shape, checked_gradient, clip_by_global_norm, global_norm,
                               squared_norm, squared_sum)
from distrib.interrupts import deferred_interrupts
from distrib.options import ReduceOp
from distrib.training_dtypes import check_trainable_dtype, compute_dtype
from distrib.values import DistributedValues, PerReplica
from distrib.variables import (IndexedSlices, Variable, VariableAggregation, creation_order, scatter_rows,
                               write_serials)

__all__ = ["Adam", "Optimizer", "SGD", "schedules"]

sys.modules.setdefault(f"{__name__}.schedules", schedules)  # `from distrib.optimizers.schedules import ...`


def _hyperparameter(value: Any, argument: str, interval: str = "[0, inf)") -> float:
    """`value` as a float, checked to lie in `interval`: "[0, inf)", "[0, 1]" or "[0, 1)"."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{argument} must be a number. Received: {type(value).__name__}.")
    below = {"[0, inf)": value < float("inf"), "[0, 1]": value <= 1, "[0, 1)": value < 1}[interval]
    if not (value >= 0 and below):
        raise ValueError(f"{argument} must be in {interval}. Received: {value}.")
    return float(value)


def _clip_argument(value: Any, argument: str) -> float | None:
    """None, or a finite number of at least 0 (0 clips nothing, as in Keras)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{argument} must be a number or None. Received: {type(value).__name__}.")
    if not (0 <= value < float("inf")):
        raise ValueError(f"{argument} must be a finite number of at least 0 (None: no clipping). Received: {value}.")
    return float(value)


def _check_schedule(schedule: Callable) -> Callable:
    """`schedule` if it can be called with one positional argument, the step."""
    try:
        inspect.signature(schedule).bind(0)
    except TypeError:
        raise TypeError(f"learning_rate must be a number or a schedule: a callable taking the step (the optimizer's "
                        f"iterations) and returning the rate. Received: {schedule!r}, which cannot be called with "
                        f"one argument.") from None
    except ValueError:  # no signature to read (some builtins): trusted
        pass
    return schedule


class Optimizer:
    """The base of SGD and Adam: averages gradients across replicas, then updates every copy of each variable.

    `apply_gradients` is called in a replica context (inside `strategy.run`) with each replica's own gradients.
    It makes one `merge_call`; there the gradients are MEAN-reduced in one packed `batch_reduce_to`, and
    `strategy.extended.update` applies the update to every replica's copy of each variable and of its slots.
    In a cross-replica context, or with no strategy, the gradients are applied directly (a PerReplica gradient
    is MEAN-reduced first).

    MEAN means each replica passes the gradient of the mean loss over its own local batch: with equal local
    batches their average is the gradient of the global batch's mean loss, whatever the number of replicas.
    TensorFlow's Keras optimizers SUM the replicas' gradients instead and expect each replica's loss to be
    scaled by the global batch size (`tf.nn.compute_average_loss`); a loss scaled that way here gives updates
    `num_replicas_in_sync` times too small.

    Slot variables are created on first use, mirrored on their variable's devices and named `<var name>/<slot>`;
    they start at zero and have the variable's dtype, except float32 for float16 variables (whose update is
    computed in float32 and rounded into the variable). `variables()` lists `iterations` and the slots, for
    checkpoints; `build(var_list)` creates them before the first step, e.g. to restore a checkpoint.

    Subclasses list `slot_names`, implement `_coefficients` (per-step scalars) and `_update_device` (the update
    of a list of variable copies on one device), and name their `_rule`, which a backend may apply instead as
    fused kernels (`Backend.fused_optimizer_update`); `_update_device` stays the reference.

    `learning_rate` may be a schedule: any callable that takes the step and returns the rate, such as those of
    `distrib.optimizers.schedules` (Keras's `LearningRateSchedule.__call__(step)`). It is called once per step, on
    the host, in the merge, with `iterations` before the update (0 at the first step), so every replica and
    device uses the same rate (on GPUs the fused kernels take it as a coefficient). `learning_rate` then reads
    as the rate of the next step, `schedule(iterations)`, as in Keras 3. The schedule is code, not state: a
    checkpoint saves `iterations`, and the schedule recomputes the rate from it.

    Gradient clipping, Keras's (2.11 and 3): after the MEAN across replicas (Keras aggregates, then clips), on
    each device with its array library, before the update. `clipnorm` scales each gradient whose L2 norm is
    above it down to that norm (`g * clipnorm / max(norm(g), clipnorm)`); `global_clipnorm` scales all gradients
    together when the norm of all of them at once is above it; `clipvalue` clips each element to
    `[-clipvalue, clipvalue]`. At most one of the three may be set, as in Keras 3; 0 clips nothing, as in Keras.

    Args:
      learning_rate: the step size, a float or a schedule; a float may be changed between steps.
      name: names `iterations` (`<name>/iterations`) and error messages.
      clipnorm: None, or the largest L2 norm of each gradient.
      clipvalue: None, or the largest absolute value of each gradient element.
      global_clipnorm: None, or the largest L2 norm of all gradients together.

    Raises:
      ValueError: more than one of clipnorm, clipvalue and global_clipnorm; a negative or infinite one.
      TypeError: a learning_rate that is neither a number nor a callable of one argument.

    Example:
      >>> import distrib, numpy as np
      >>> w = distrib.Variable(np.ones(2, np.float32), name="w")
      >>> opt = distrib.optimizers.SGD(learning_rate=0.5)
      >>> opt.apply_gradients([(np.ones(2, np.float32), w)])
      <Variable 'SGD/iterations' shape=() dtype=int64 device=CPU:0>
      >>> w.numpy(), int(opt.iterations.numpy())
      (array([0.5, 0.5], dtype=float32), 1)
    """

    slot_names: tuple[str, ...] = ()
    _rule = ""  # the update's name for Backend.fused_optimizer_update

    def __init__(self, learning_rate: float | Callable, name: str, clipnorm: float | None = None,
                 clipvalue: float | None = None, global_clipnorm: float | None = None):
        self._schedule: Callable | None = None
        self._scheduled: tuple[int, float] | None = None  # (step, the schedule's rate for it)
        self.learning_rate = learning_rate
        clips = {"clipnorm": clipnorm, "clipvalue": clipvalue, "global_clipnorm": global_clipnorm}
        if sum(value is not None for value in clips.values()) > 1:
            raise ValueError(f"Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be set. Received: "
                             f"clipnorm={clipnorm}, clipvalue={clipvalue}, global_clipnorm={global_clipnorm}.")
        self.clipnorm, self.clipvalue, self.global_clipnorm = (_clip_argument(v, k) for k, v in clips.items())
        self.name = name
        self._strategy = context.get_strategy() if context.has_strategy() else None
        self._iterations: Variable | DistributedVariable | None = None
        self._counted: tuple[tuple[int, ...], int] | None = None  # (iterations' write serials, its value) after a step
        self._slots: dict[Any, dict[str, Any]] = {}  # variable -> {slot name: slot variable}
        self._slot_list: list[Any] = []  # in creation order

    @property
    def learning_rate(self) -> float:
        """The rate of the next step: the float given, or the schedule's value at `iterations` (Keras 3's reading)."""
        if self._schedule is None:
            return self._learning_rate
        return self._scheduled_rate(self._iterations_count() if self._iterations is not None else 0)

    @learning_rate.setter
    def learning_rate(self, value: float | Callable) -> None:
        if callable(value) and not isinstance(value, numbers.Real):
            self._schedule, self._learning_rate = _check_schedule(value), None
            return
        if self._schedule is not None:
            raise TypeError("This optimizer was created with a schedule as its `learning_rate`, hence its learning "
                            "rate is not settable to a number. If you need the learning rate to be settable, "
                            "create the optimizer with a float `learning_rate` (Keras's rule).")
        self._learning_rate = _hyperparameter(value, "learning_rate")

    @property
    def schedule(self) -> Callable | None:
        """The learning-rate schedule, or None for a constant rate."""
        return self._schedule

    def _scheduled_rate(self, step: int) -> float:
        """The schedule's rate at `step` (iterations before the update), checked to be a number of at least 0."""
        value = self._schedule(step)
        try:
            if isinstance(value, (str, bytes)):
                raise TypeError
            rate = float(value)  # a Python or NumPy number, a 0-d array of any library
        except (TypeError, ValueError):
            raise TypeError(f"A learning_rate schedule must return a number. Received: {type(value).__name__} from "
                            f"{self._schedule!r} at step {step}.") from None
        if not 0 <= rate < float("inf"):
            raise ValueError(f"A learning_rate schedule must return a number in [0, inf). Received: {rate} from "
                             f"{self._schedule!r} at step {step}.")
        return rate

    def _rate(self, step: int) -> float:
        """The learning rate of step `step` (counting from 1): the schedule is called once per step."""
        if self._schedule is None:
            return self._learning_rate
        scheduled = self._scheduled
        if scheduled is None or scheduled[0] != step:
            scheduled = self._scheduled = (step, self._scheduled_rate(step - 1))
        return scheduled[1]

    @property
    def iterations(self) -> Variable | DistributedVariable:
        """How many times gradients were applied: an int64 variable (mirrored, ONLY_FIRST_REPLICA aggregation)."""
        if self._iterations is None:
            self._create_iterations(self._strategy or context.get_strategy())
        return self._iterations

    def variables(self) -> list:
        """`iterations` and the slot variables created so far (what a checkpoint saves): each variable's slots in
        the order those variables were created, whatever order the steps pass them in. A checkpoint tells slots
        of variables with the same name apart by that order (`_1`, `_2`...), so a program that lists its
        gradients in another order still restores each slot to its own variable."""
        owners = list(self._slots)
        serials = [creation_order(var) for var in owners]
        if None not in serials:  # else (a parameter server's variables) the order the slots were made in
            owners = [owners[k] for k in sorted(range(len(owners)), key=serials.__getitem__)]
        slots = [slot for var in owners for slot in self._slots[var].values()]
        return ([self._iterations] if self._iterations is not None else []) + slots

    def get_slot_names(self) -> list[str]:
        return list(self.slot_names)

    def may_create(self, name: str) -> bool:
        """Whether this optimizer may create a variable saved as `name` (see `variables`): `<its name>/iterations`
        and `<variable>/<one of slot_names>`, numbered `_1`... when names repeat. A checkpoint's restore asks, so
        that state saved by another kind of optimizer is refused rather than left waiting for good."""
        slots = "|".join(re.escape(slot) for slot in self.slot_names)
        pattern = re.escape(f"{self.name}/iterations") + (f"|.+/(?:{slots})(?:_\\d+)*" if slots else "")
        return re.fullmatch(pattern, name) is not None

    def get_slot(self, var: Any, slot_name: str) -> Any:
        """The slot variable `slot_name` (one of `slot_names`) of `var`."""
        if slot_name not in self.slot_names:
            raise ValueError(f"{type(self).__name__} has slots {list(self.slot_names)}. Received: {slot_name!r}.")
        if var not in self._slots:
            raise KeyError(f"{type(self).__name__} has no slots for variable {getattr(var, 'name', var)!r} yet: "
                           f"they are created by its first apply_gradients (or build).")
        return self._slots[var][slot_name]

    def build(self, var_list: Iterable[Any]) -> None:
        """Creates `iterations` and the slots of `var_list` now, in a cross-replica context (e.g. before a restore)."""
        strategy = context.get_strategy()
        variables = list(var_list)
        if hasattr(strategy.extended, "_build_optimizer"):  # a strategy that keeps slots elsewhere (on servers)
            return strategy.extended._build_optimizer(self, variables)
        for position, var in enumerate(variables):
            _check_variable(strategy, var, position)
        self._build(strategy, variables)

    # -- applying ---------------------------------------------------------------------------------------

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]], name: str | None = None,
                        skip_gradients_aggregation: bool = False, experimental_aggregate_gradients: bool = True
                        ) -> Any:
        """Applies (gradient, variable) pairs; returns `iterations`. See `apply`, which also checks that there is
        one gradient per variable (a `zip` of unequal lists is cut short before it gets here).

        `name` is accepted and ignored, as in TensorFlow 2 (it named a graph scope). `skip_gradients_aggregation=
        True` or `experimental_aggregate_gradients=False` (Keras's two spellings) mean the gradients are
        aggregated already: no all-reduce, and each copy of a mirrored variable is updated with its own replica's
        gradient, as Keras's `extended.update(var, fn, args=(grad,))` does. They must then be equal on every
        replica; like TensorFlow, distrib does not check, and different ones leave the copies different.
        """
        pairs = list(grads_and_vars)
        for position, pair in enumerate(pairs):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise TypeError(f"apply_gradients needs (gradient, variable) pairs. Received: {pair!r} at "
                                f"position {position}.")
        aggregate = not skip_gradients_aggregation and experimental_aggregate_gradients
        return self._apply([g for g, _ in pairs], [v for _, v in pairs], bool(aggregate))

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any]) -> Any:
        """Applies one gradient per variable (None: skip that variable, with a warning); returns `iterations`.

        A gradient is an array of the variable's shape, or an `IndexedSlices` (rows of a sparse gradient, e.g. an
        embedding's), which each replica densifies on its variable's device before the all-reduce: repeated rows
        add up. For Adam and plain SGD that is Keras's sparse update (moments decay on every row); SGD with
        momentum updates only the rows some replica's IndexedSlices names, as Keras's sparse momentum kernel does.

        Raises:
          ValueError: different numbers of gradients and variables; a gradient whose shape is not its
            variable's; every gradient None; a variable of another strategy.
          TypeError: something that is not a floating-point variable of this strategy; a gradient that is not
            an array of floating-point numbers (complex, integer, bool, ragged lists, objects).
          IndexError: IndexedSlices indices outside the variable's rows.
        """
        return self._apply(grads, trainable_variables, True)

    def _apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any], aggregate: bool) -> Any:
        grads, variables = list(grads), list(trainable_variables)
        if len(grads) != len(variables):
            raise ValueError(f"apply needs one gradient per variable. Received: {len(grads)} gradients for "
                             f"{len(variables)} variables.")
        strategy = context.get_strategy()
        applied_elsewhere = hasattr(strategy.extended, "_apply_optimizer")  # where the variables live (servers)
        for position, var in enumerate(variables if not applied_elsewhere else ()):
            _check_variable(strategy, var, position)
        kept = [(g, v) for g, v in zip(grads, variables) if g is not None]
        if not kept:
            raise ValueError(f"No gradients provided for any variable: {[v.name for v in variables]}.")
        replica_context = context.get_replica_context()
        if len(kept) < len(variables) and (replica_context is None or replica_context.replica_id_in_sync_group == 0):
            # Keras's warning, once per step rather than once per replica
            missing = [getattr(v, "name", v) for g, v in zip(grads, variables) if g is None]
            warnings.warn(f"Gradients do not exist for variables {missing} when minimizing the loss.", stacklevel=3)
        if applied_elsewhere:  # each worker's gradients apply as they are there: nothing to aggregate
            if any(isinstance(g, IndexedSlices) for g, _ in kept):
                raise TypeError(f"Optimizers under {type(strategy).__name__} take dense gradients. Received: an "
                                f"IndexedSlices for a variable; pass the dense gradient.")
            kept = [(checked_gradient(g, v), v) for g, v in kept]
            if self._clips():  # on the worker, with NumPy: what the servers get is already clipped
                arrays = [to_numpy(g.values[0] if isinstance(g, DistributedValues) else g).astype(
                    compute_dtype(v.dtype), copy=False) for g, v in kept]  # the servers' dtype (float32 for halves)
                kept = list(zip(self._clipped(np, arrays), [v for _, v in kept]))
            return strategy.extended._apply_optimizer(self, [g for g, _ in kept], [v for _, v in kept])
        grads, variables, touched = [], [], []
        for grad, var in kept:
            if type(grad) is not np.ndarray or grad.dtype.kind != "f":  # the usual gradient needs neither step
                grad, rows = self._dense_gradient(checked_gradient(grad, var), var)
            else:
                rows = _DENSE
            check_gradient_shape(grad, var)
            grads.append(grad)
            variables.append(var)
            touched.append(rows)
        if not self._rows_only:
            touched = None  # the same on every replica: merge_call's args must have one structure
        if replica_context is None:
            return self._apply_cross_replica(strategy, grads, variables, touched, aggregate)
        if touched is None and aggregate:  # the usual step: two arguments fewer for merge_call to regroup
            return replica_context.merge_call(self._apply_cross_replica, args=(grads, variables))
        return replica_context.merge_call(self._apply_cross_replica, args=(grads, variables, touched, aggregate))

    _rows_only = False  # whether an IndexedSlices gradient updates only its rows (Keras's sparse momentum)

    def _dense_gradient(self, grad: Any, var: Any) -> tuple[Any, Any]:
        """(`grad`, _DENSE), or for an IndexedSlices (also inside a PerReplica) its dense array on the variable's
        device and, where the update is row-wise (`_rows_only`), a float32 marker of its rows."""
        if isinstance(grad, DistributedValues):
            if not any(isinstance(c, IndexedSlices) for c in grad.values):
                return grad, _DENSE
            components = var.values if isinstance(var, DistributedVariable) else (var,) * len(grad.values)
            pairs = [self._dense_gradient(c, component) for c, component in zip(grad.values, components)]
            rows = [r for _, r in pairs]
            return PerReplica(tuple(d for d, _ in pairs)), (PerReplica(tuple(rows)) if self._rows_only else None)
        if not isinstance(grad, IndexedSlices):
            return grad, _DENSE
        component = var._get() if isinstance(var, DistributedVariable) else var
        try:  # the checks of Variable.scatter_*: integer indices within the rows, values of shape indices + rows
            indices, values = component._sparse_operands("apply_gradients", grad)
        except (TypeError, ValueError, IndexError) as error:  # named after the variable, not its copy
            raise type(error)(str(error).replace(repr(component.name), repr(var.name))) from None
        backend = component._backend
        with backend.device_scope(component.device):
            dense = backend.xp.zeros(component.shape, values.dtype)
            scatter_rows(backend.xp, dense, "scatter_add", indices, values)  # Keras sums repeated rows too
            if not self._rows_only:
                return dense, None
            rows = backend.xp.zeros(component.shape[0], np.float32)
            rows[indices.reshape(-1)] = 1
        return dense, rows

    def _apply_cross_replica(self, strategy: Any, grads: list, variables: list, touched: list | None = None,
                             aggregate: bool = True) -> Any:
        """The merge: one packed MEAN reduction (unless the gradients come aggregated), then the update of every
        copy of every variable."""
        self._build(strategy, variables)
        extended = strategy.extended
        # rows of row-wise updates: only where every replica gave IndexedSlices (a dense one anywhere makes the
        # sum dense, as in TensorFlow); their MEAN is nonzero on the rows that any replica named
        rows = [None if t is _DENSE or (isinstance(t, DistributedValues) and any(c is _DENSE for c in t.values))
                else t for t in touched] if touched is not None else [None] * len(variables)
        if aggregate:
            destinations = [v if isinstance(v, DistributedVariable) else v.device for v in variables]
            sparse = [k for k, r in enumerate(rows) if r is not None]
            reduced = extended.batch_reduce_to(ReduceOp.MEAN, list(zip(grads, destinations)) +
                                               [(rows[k], destinations[k]) for k in sparse])
            grads = reduced[:len(grads)]
            for k, r in zip(sparse, reduced[len(grads):]):
                rows[k] = r
        step = self._iterations_count() + 1
        if self._schedule is not None:  # once per step, on the host: the same rate for every device
            self._scheduled = (step, self._scheduled_rate(step - 1))
        # (device, compute dtype, row-wise) -> [(copy, gradient, slot copies[, rows])]
        groups: dict[tuple[str, np.dtype, bool], list] = {}
        # `groups` is bound rather than passed in args: update unwraps args per copy, and walking every variable
        # filed so far at each call made a step quadratic in the number of variables
        collect = functools.partial(self._collect, groups, None)
        backend = extended.backend
        # Ctrl-C lands before the step's writes or after all of them; one block for the whole step, so that each
        # update filing a variable's copies nests in it instead of swapping the SIGINT handler twice
        with deferred_interrupts():
            for var, grad, var_rows in zip(variables, grads, rows):
                slots = [PerReplica(s.values) if isinstance(s, DistributedVariable) else s
                         for s in self._slots[var].values()]  # update hands each copy its own slot copies
                if var_rows is None:  # dense: an argument fewer for update to unwrap per copy
                    extended.update(var, collect, args=(grad, *slots), group=False)
                else:
                    extended.update(var, lambda copy, rows, g, *s: self._collect(groups, rows, copy, g, *s),
                                    args=(var_rows, grad, *slots), group=False)
            if self._clips():
                self._clip_groups(backend, groups, len(variables))
            for (device, dtype, row_wise), items in groups.items():  # the backend's fused kernels if any, else
                coefficients = self._coefficients(dtype, step)       # array math
                with backend.device_scope(device):
                    if row_wise:  # no fused kernel updates some rows only
                        self._update_rows(backend.xp, items, coefficients)
                    elif not backend.fused_optimizer_update(self._rule, items, coefficients):
                        self._update_device(backend.xp, items, coefficients)
            self.iterations.assign_add(1)
            self._counted = (write_serials(self._iterations), step)
        return self.iterations

    def _clips(self) -> bool:
        """Whether the gradients are clipped (Keras's test: a value above 0)."""
        return bool(self.clipnorm and self.clipnorm > 0 or self.global_clipnorm and self.global_clipnorm > 0 or
                    self.clipvalue and self.clipvalue > 0)

    def _clipped(self, xp: Any, grads: list) -> list:
        """Keras's `_clip_gradients` on `grads`, arrays of one device: new arrays, nothing written in place (the
        reduced gradient may be one buffer for several copies)."""
        if self.clipnorm and self.clipnorm > 0:
            clipped = []
            for g in grads:  # Keras's _clip_by_norm: g * clipnorm / max(||g||, clipnorm)
                clip = g.dtype.type(self.clipnorm)
                clipped.append(g * (clip / xp.maximum(xp.sqrt(squared_sum(xp, g)), clip)))
            return clipped
        if self.global_clipnorm and self.global_clipnorm > 0:
            return clip_by_global_norm(xp, grads, global_norm(xp, grads), self.global_clipnorm)
        if self.clipvalue and self.clipvalue > 0:
            return [xp.clip(g, -g.dtype.type(self.clipvalue), g.dtype.type(self.clipvalue)) for g in grads]
        return grads

    def _clip_groups(self, backend: Any, groups: dict, count: int) -> None:
        """Clips the gradients filed in `groups` (the merge's), device by device. Each device holds a copy of every
        variable's gradient (mirrored variables), so each computes the global norm itself; plain variables on
        different devices (the default strategy) add up their devices' squared norms on the host instead."""
        by_device: dict[str, list] = {}
        for (device, _, _), items in groups.items():
            by_device.setdefault(device, []).append(items)
        total = None
        if self.global_clipnorm and self.global_clipnorm > 0 and any(
                sum(map(len, lists)) != count for lists in by_device.values()):
            squares = 0.0
            for device, lists in by_device.items():
                with backend.device_scope(device):
                    squares += float(squared_norm(backend.xp, [item[1] for items in lists for item in items]))
            total = math.sqrt(squares)
        for device, lists in by_device.items():
            with backend.device_scope(device):
                grads = [item[1] for items in lists for item in items]
                if total is None:
                    clipped = iter(self._clipped(backend.xp, grads))
                else:
                    clipped = iter(clip_by_global_norm(backend.xp, grads, total, self.global_clipnorm))
                for items in lists:
                    items[:] = [(item[0], next(clipped), *item[2:]) for item in items]

    def _iterations_count(self) -> int:
        """`iterations` as a Python int, read from the device only if something other than `apply` wrote it since
        the last step: reading it back would wait for every queued step, so GPU steps could never overlap."""
        counted = self._counted
        return counted[1] if counted and counted[0] == write_serials(self._iterations) else int(self.iterations.numpy())

    def _collect(self, groups: dict, rows: Any, component: Variable, grad: Any, *slots: Variable) -> None:
        """`extended.update`'s fn: files one copy of one variable, with its gradient on its device, by group (rows:
        None for a dense update, else the marker of the rows a row-wise one writes)."""
        dtype = compute_dtype(component.dtype)
        backend = self._strategy.extended.backend
        grad = backend.to_device(grad, component.device).astype(dtype, copy=False)
        if rows is None:
            groups.setdefault((component.device, dtype, False), []).append((component, grad, slots))
        else:
            rows = backend.xp.flatnonzero(backend.to_device(rows, component.device))
            groups.setdefault((component.device, dtype, True), []).append((component, grad, slots, rows))

    def _update_device(self, xp: Any, items: list[tuple[Variable, Any, tuple]], coefficients: tuple) -> None:
        """Updates (variable copy, gradient, slot copies) triples on one device, writing in place."""
        raise NotImplementedError

    def _update_rows(self, xp: Any, items: list[tuple[Variable, Any, tuple, Any]], coefficients: tuple) -> None:
        """Like `_update_device`, for the rows `rows` of each (variable copy, gradient, slot copies, rows) only;
        for optimizers with `_rows_only`."""
        raise NotImplementedError

    def _coefficients(self, dtype: np.dtype, step: int) -> tuple:
        """This step's scalars in `dtype` (step counts from 1; the learning rate is `self._rate(step)`)."""
        raise NotImplementedError

    def _repr_rate(self) -> str:
        """`learning_rate=...` and the clipping argument set, for __repr__ (a schedule shows itself, uncalled)."""
        text = f"learning_rate={self._schedule if self._schedule is not None else self._learning_rate!r}"
        for name in ("clipnorm", "clipvalue", "global_clipnorm"):
            if getattr(self, name) is not None:
                text += f" {name}={getattr(self, name)}"
        return text

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} {self._repr_rate()}>"

    # -- state: iterations and slots --------------------------------------------------------------------

    def _bind(self, strategy: Any) -> Any:
        if self._strategy is None:
            self._strategy = strategy
        elif strategy is not self._strategy:
            raise ValueError(f"{self.name} keeps its iterations and slots on {self._strategy!r} and cannot be used "
                             f"under {strategy!r}. Create one optimizer per strategy, inside its scope().")
        return strategy

    def _build(self, strategy: Any, variables: list) -> None:
        self._bind(strategy)
        if self._iterations is None:
            self._create_iterations(strategy)
        created = False
        for var in variables:
            if var not in self._slots:
                self._slots[var] = {name: self._create_slot(strategy, var, name) for name in self.slot_names}
                created = True
        if created:  # slots restored from a checkpoint before they existed get their saved values now
            restore_deferred(self)

    def _create_iterations(self, strategy: Any) -> None:
        with self._bind(strategy).scope():
            self._iterations = Variable(np.int64(0), trainable=False, name=f"{self.name}/iterations",
                                        aggregation=VariableAggregation.ONLY_FIRST_REPLICA)

    def _create_slot(self, strategy: Any, var: Any, slot_name: str) -> Any:
        zeros = np.zeros(var.shape, compute_dtype(var.dtype))
        name = f"{var.name}/{slot_name}"
        if not isinstance(var, Variable):  # a strategy's variable: the slot goes where it is
            with strategy.scope(), strategy.extended.colocate_vars_with(var):
                slot = Variable(zeros, trainable=False, name=name)
        else:
            slot = Variable(zeros, trainable=False, name=name, device=var.device, backend=strategy.extended.backend)
        self._slot_list.append(slot)
        return slot


_DENSE = np.zeros(0, np.float32)  # `touched`'s marker of a dense gradient: one object, so regroup keeps it


def _check_variable(strategy: Any, var: Any, position: int) -> None:
    if isinstance(var, DistributedVariable):
        if var._strategy is not strategy:
            raise ValueError(f"Optimizers update variables of the strategy they run under. Received: variable "
                             f"{var.name!r} of {var._strategy!r} under {strategy!r}; call apply_gradients inside "
                             f"strategy.run or strategy.scope() of the variable's strategy.")
        if not isinstance(var, MirroredVariable):
            raise TypeError(f"Optimizers update MirroredVariables. Received: {type(var).__name__} {var.name!r}.")
    elif isinstance(var, Variable):
        if not context.is_default(strategy):
            raise ValueError(f"Optimizers update variables of the strategy they run under. Received: variable "
                             f"{var.name!r}, created outside any strategy, under {strategy!r}; create it inside "
                             f"strategy.scope().")
    elif type(var).__module__.startswith("distrib.parameter_server"):  # its strategy is not the current one
        raise ValueError(f"A parameter server's variable is updated under its ParameterServerStrategy. Received: "
                         f"{type(var).__name__} {var.name!r} at position {position} under {strategy!r}; call "
                         f"apply_gradients under strategy.scope(), inside strategy.run, or in a scheduled closure.")
    else:
        raise TypeError(f"Optimizers update distrib variables. Received: {type(var).__name__} at position "
                        f"{position}.")
    check_trainable_dtype(var)


class SGD(Optimizer):
    """Gradient descent, with optional (Nesterov) momentum, as Keras defines it.

    Plain: `var -= lr * g`. With momentum: `m = momentum * m - lr * g; var += m`; with Nesterov too:
    `m = momentum * m - lr * g; var += momentum * m - lr * g`. `g` is the MEAN of the replicas' gradients, so
    each replica passes the gradient of its local batch's mean loss (TensorFlow's Keras optimizers SUM instead,
    with losses scaled by the global batch size). With momentum the slot is `momentum` (`<var name>/momentum`):
    the variable's dtype, float32 for float16 variables.

    Args:
      learning_rate: the step size `lr`, a float (may be changed between steps) or a schedule (see `Optimizer`).
      momentum: in [0, 1]; 0 means plain gradient descent and no slot.
      nesterov: whether to apply Nesterov momentum.
      name: names `iterations` and error messages.
      clipnorm, clipvalue, global_clipnorm: gradient clipping, Keras's (see `Optimizer`); at most one.

    Example:
      >>> import distrib, numpy as np
      >>> strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
      >>> with strategy.scope():
      ...     w = distrib.Variable(np.ones(2, np.float32), name="w")
      ...     opt = distrib.optimizers.SGD(learning_rate=0.1, momentum=0.9)
      >>> def step():
      ...     g = np.full(2, distrib.get_replica_context().replica_id_in_sync_group, np.float32)
      ...     opt.apply_gradients([(g, w)])  # replica gradients 0 and 1: their mean is 0.5
      >>> strategy.run(step)
      >>> w.numpy(), opt.get_slot(w, "momentum").numpy()
      (array([0.95, 0.95], dtype=float32), array([-0.05, -0.05], dtype=float32))
    """

    def __init__(self, learning_rate: float | Callable = 0.01, momentum: float = 0.0, nesterov: bool = False,
                 name: str = "SGD", *, clipnorm: float | None = None, clipvalue: float | None = None,
                 global_clipnorm: float | None = None):
        super().__init__(learning_rate, name, clipnorm, clipvalue, global_clipnorm)
        self.momentum = _hyperparameter(momentum, "momentum", "[0, 1]")
        self.nesterov = bool(nesterov)
        self.slot_names = ("momentum",) if self.momentum else ()
        # Keras's sparse momentum kernel (ResourceSparseApplyKerasMomentum) leaves unnamed rows alone: their
        # momentum neither decays nor moves the weights, unlike a dense zero gradient's
        self._rows_only = bool(self.momentum)

    @property
    def _rule(self) -> str:
        if not self.slot_names:
            return "sgd"
        return "nesterov" if self.nesterov else "momentum"

    def _coefficients(self, dtype, step):
        return dtype.type(self._rate(step)), dtype.type(self.momentum)

    def _update_device(self, xp, items, coefficients):
        lr, momentum = coefficients
        for var, grad, slots in items:  # on the buffers themselves: shapes and dtypes were checked once per step
            w = var._writable()
            if not slots:
                xp.subtract(w, lr * grad, out=w, casting="same_kind")
                continue
            m = slots[0]._writable()
            xp.copyto(m, momentum * m - lr * grad, casting="same_kind")
            if self.nesterov:
                xp.add(w, momentum * m - lr * grad, out=w, casting="same_kind")
            else:
                xp.add(w, m, out=w, casting="same_kind")

    def _update_rows(self, xp, items, coefficients):
        lr, momentum = coefficients
        for var, grad, slots, rows in items:
            w, m = var._writable(), slots[0]._writable()
            g = grad[rows]
            accum = momentum * m[rows] - lr * g
            m[rows] = accum
            w[rows] = w[rows] + (momentum * accum - lr * g if self.nesterov else accum)

    def __repr__(self) -> str:
        return f"<SGD name={self.name!r} {self._repr_rate()} momentum={self.momentum} nesterov={self.nesterov}>"


class Adam(Optimizer):
    """Adam, as Keras defines it (with `epsilon` added to `sqrt(v)`, TensorFlow's "epsilon hat").

    At step `t = iterations + 1`: `lr_t = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)`,
    `m += (g - m) * (1 - beta_1)`, `v += (g**2 - v) * (1 - beta_2)` (i.e. `m = beta_1 * m + (1 - beta_1) * g`
    and likewise `v`), `var -= lr_t * m / (sqrt(v) + epsilon)`. `g` is the MEAN of the replicas' gradients, so
    each replica passes the gradient of its local batch's mean loss (TensorFlow's Keras optimizers SUM instead,
    with losses scaled by the global batch size). The slots are `m` and `v` (`<var name>/m`, `<var name>/v`):
    the variable's dtype, float32 for float16 variables.

    Args:
      learning_rate: the step size `lr`, a float (may be changed between steps) or a schedule (see `Optimizer`).
      beta_1: decay of the first-moment estimate `m`, in [0, 1).
      beta_2: decay of the second-moment estimate `v`, in [0, 1).
      epsilon: added to `sqrt(v)` for numerical stability.
      name: names `iterations` and error messages.
      clipnorm, clipvalue, global_clipnorm: gradient clipping, Keras's (see `Optimizer`); at most one.

    Example:
      >>> import distrib, numpy as np
      >>> strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
      >>> with strategy.scope():
      ...     w = distrib.Variable(np.ones(2, np.float32), name="w")
      ...     opt = distrib.optimizers.Adam(learning_rate=0.1)
      >>> strategy.run(lambda: opt.apply_gradients([(np.full(2, 3.0, np.float32), w)]))
      <MirroredVariable 'Adam/iterations' shape=() dtype=int64 devices=('CPU:0', 'CPU:1')>
      >>> w.numpy().round(5)  # the first step moves each weight by about lr, whatever the gradient's scale
      array([0.9, 0.9], dtype=float32)
    """

    slot_names = ("m", "v")
    _rule = "adam"

    def __init__(self, learning_rate: float | Callable = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, name: str = "Adam", *, clipnorm: float | None = None,
                 clipvalue: float | None = None, global_clipnorm: float | None = None):
        super().__init__(learning_rate, name, clipnorm, clipvalue, global_clipnorm)
        self.beta_1 = _hyperparameter(beta_1, "beta_1", "[0, 1)")
        self.beta_2 = _hyperparameter(beta_2, "beta_2", "[0, 1)")
        self.epsilon = _hyperparameter(epsilon, "epsilon")

    def _coefficients(self, dtype, step):  # Keras's casts: powers and lr_t in `dtype`, 1 - beta in Python
        one, t = dtype.type(1), dtype.type(step)
        beta_1_power, beta_2_power = dtype.type(self.beta_1) ** t, dtype.type(self.beta_2) ** t
        lr_t = dtype.type(self._rate(step)) * np.sqrt(one - beta_2_power) / (one - beta_1_power)
        return lr_t, dtype.type(1 - self.beta_1), dtype.type(1 - self.beta_2), dtype.type(self.epsilon)

    def _update_device(self, xp, items, coefficients):
        lr_t, one_minus_beta_1, one_minus_beta_2, epsilon = coefficients
        for var, grad, slots in items:  # on the buffers themselves: shapes and dtypes were checked once per step
            m, v, w = slots[0]._writable(), slots[1]._writable(), var._writable()
            xp.add(m, (grad - m) * one_minus_beta_1, out=m, casting="same_kind")
            xp.add(v, (xp.square(grad) - v) * one_minus_beta_2, out=v, casting="same_kind")
            xp.subtract(w, m * lr_t / (xp.sqrt(v) + epsilon), out=w, casting="same_kind")

    def __repr__(self) -> str:
        return (f"<Adam name={self.name!r} {self._repr_rate()} beta_1={self.beta_1} "
                f"beta_2={self.beta_2} epsilon={self.epsilon}>")
