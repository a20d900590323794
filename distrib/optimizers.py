"""Optimizers that average the replicas' gradients and update every copy of a mirrored variable: SGD and Adam."""

from __future__ import annotations

import functools
import numbers
import re
import warnings
from typing import Any, Iterable, Sequence

import numpy as np

from distrib import context
from distrib.checkpoint import restore_deferred
from distrib.distributed_variables import DistributedVariable, MirroredVariable
from distrib.interrupts import deferred_interrupts
from distrib.options import ReduceOp
from distrib.plan import dtype_name
from distrib.training_dtypes import check_trainable_dtype, compute_dtype
from distrib.values import DistributedValues, PerReplica
from distrib.variables import IndexedSlices, Variable, VariableAggregation, scatter_rows, write_serials

__all__ = ["Adam", "Optimizer", "SGD"]


def _hyperparameter(value: Any, argument: str, interval: str = "[0, inf)") -> float:
    """`value` as a float, checked to lie in `interval`: "[0, inf)", "[0, 1]" or "[0, 1)"."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{argument} must be a number. Received: {type(value).__name__}.")
    below = {"[0, inf)": value < float("inf"), "[0, 1]": value <= 1, "[0, 1)": value < 1}[interval]
    if not (value >= 0 and below):
        raise ValueError(f"{argument} must be in {interval}. Received: {value}.")
    return float(value)


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

    Args:
      learning_rate: the step size, a float; may be changed between steps.
      name: names `iterations` (`<name>/iterations`) and error messages.

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

    def __init__(self, learning_rate: float, name: str):
        self.learning_rate = learning_rate
        self.name = name
        self._strategy = context.get_strategy() if context.has_strategy() else None
        self._iterations: Variable | DistributedVariable | None = None
        self._counted: tuple[tuple[int, ...], int] | None = None  # (iterations' write serials, its value) after a step
        self._slots: dict[Any, dict[str, Any]] = {}  # variable -> {slot name: slot variable}
        self._slot_list: list[Any] = []  # in creation order

    @property
    def learning_rate(self) -> float:
        return self._learning_rate

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        self._learning_rate = _hyperparameter(value, "learning_rate")

    @property
    def iterations(self) -> Variable | DistributedVariable:
        """How many times gradients were applied: an int64 variable (mirrored, ONLY_FIRST_REPLICA aggregation)."""
        if self._iterations is None:
            self._create_iterations(self._strategy or context.get_strategy())
        return self._iterations

    def variables(self) -> list:
        """`iterations` and the slot variables created so far, in creation order (what a checkpoint saves)."""
        return ([self._iterations] if self._iterations is not None else []) + list(self._slot_list)

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
            kept = [(_checked_gradient(g, v), v) for g, v in kept]
            return strategy.extended._apply_optimizer(self, [g for g, _ in kept], [v for _, v in kept])
        grads, variables, touched = [], [], []
        for grad, var in kept:
            if type(grad) is not np.ndarray or grad.dtype.kind != "f":  # the usual gradient needs neither step
                grad, rows = self._dense_gradient(_checked_gradient(grad, var), var)
            else:
                rows = _DENSE
            _check_gradient_shape(grad, var)
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
        """This step's scalars in `dtype` (step counts from 1)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} learning_rate={self.learning_rate}>"

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


def _check_gradient_shape(grad: Any, var: Any) -> None:
    components = grad.values if isinstance(grad, DistributedValues) else (grad,)
    for component in components:
        if tuple(np.shape(component)) != tuple(var.shape):
            raise ValueError(f"A gradient must have its variable's shape. Received: shape "
                             f"{tuple(np.shape(component))} for variable {var.name!r} of shape {var.shape}.")


def _regrouped_slices(grad: IndexedSlices) -> Any:
    """A PerReplica of IndexedSlices for IndexedSlices of PerReplica values or indices (what a distributed
    function returning IndexedSlices gives, as a NamedTuple is a structure); else `grad` itself."""
    parts = [p for p in (grad.values, grad.indices) if isinstance(p, DistributedValues)]
    if not parts:
        return grad
    count = len(parts[0].values)
    pick = lambda p, i: p.values[i] if isinstance(p, DistributedValues) else p  # noqa: E731
    return PerReplica(tuple(IndexedSlices(pick(grad.values, i), pick(grad.indices, i), grad.dense_shape)
                            for i in range(count)))


def _checked_gradient(grad: Any, var: Any) -> Any:
    """`grad`, a list made an array, after checking that it holds floating-point numbers: its values are cast to
    the variable's compute dtype, and a complex, integer or bool gradient is a mistake that cast would hide (TF2's
    Keras refuses any dtype but the variable's; distrib, like Keras 3, casts between floating-point dtypes)."""
    if isinstance(grad, IndexedSlices):
        grad = _regrouped_slices(grad)
    if isinstance(grad, IndexedSlices):
        _check_gradient_dtype(grad.values, var)
        return grad
    if isinstance(grad, DistributedValues):
        for component in grad.values:
            _check_gradient_dtype(component.values if isinstance(component, IndexedSlices) else component, var)
        return grad
    return _check_gradient_dtype(grad, var)


def _check_gradient_dtype(grad: Any, var: Any) -> Any:
    dtype = getattr(grad, "dtype", None)
    if dtype is None or isinstance(grad, (list, tuple)):  # lists, numbers, __array__ objects: NumPy's reading
        try:
            grad = np.asarray(grad)
        except ValueError as error:  # ragged nesting
            raise TypeError(f"A gradient must be an array of numbers for variable {var.name!r}. Received: a "
                            f"ragged {type(grad).__name__} ({error}).") from None
        dtype = grad.dtype
    try:
        dtype = np.dtype(dtype)
    except TypeError:  # another library's dtype (torch.float32): by its name, or left to the copy to NumPy
        try:
            dtype = np.dtype(str(dtype).rsplit(".", 1)[-1])
        except TypeError:
            return grad
    if dtype.kind != "f" and dtype_name(dtype) != "bfloat16":
        raise TypeError(f"A gradient must hold floating-point numbers for variable {var.name!r} of dtype "
                        f"{var.dtype}. Received: dtype {dtype}.")
    return grad


class SGD(Optimizer):
    """Gradient descent, with optional (Nesterov) momentum, as Keras defines it.

    Plain: `var -= lr * g`. With momentum: `m = momentum * m - lr * g; var += m`; with Nesterov too:
    `m = momentum * m - lr * g; var += momentum * m - lr * g`. `g` is the MEAN of the replicas' gradients, so
    each replica passes the gradient of its local batch's mean loss (TensorFlow's Keras optimizers SUM instead,
    with losses scaled by the global batch size). With momentum the slot is `momentum` (`<var name>/momentum`):
    the variable's dtype, float32 for float16 variables.

    Args:
      learning_rate: the step size `lr`, a float; may be changed between steps.
      momentum: in [0, 1]; 0 means plain gradient descent and no slot.
      nesterov: whether to apply Nesterov momentum.
      name: names `iterations` and error messages.

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

    def __init__(self, learning_rate: float = 0.01, momentum: float = 0.0, nesterov: bool = False,
                 name: str = "SGD"):
        super().__init__(learning_rate, name)
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
        return dtype.type(self.learning_rate), dtype.type(self.momentum)

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
        return (f"<SGD name={self.name!r} learning_rate={self.learning_rate} momentum={self.momentum} "
                f"nesterov={self.nesterov}>")


class Adam(Optimizer):
    """Adam, as Keras defines it (with `epsilon` added to `sqrt(v)`, TensorFlow's "epsilon hat").

    At step `t = iterations + 1`: `lr_t = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)`,
    `m += (g - m) * (1 - beta_1)`, `v += (g**2 - v) * (1 - beta_2)` (i.e. `m = beta_1 * m + (1 - beta_1) * g`
    and likewise `v`), `var -= lr_t * m / (sqrt(v) + epsilon)`. `g` is the MEAN of the replicas' gradients, so
    each replica passes the gradient of its local batch's mean loss (TensorFlow's Keras optimizers SUM instead,
    with losses scaled by the global batch size). The slots are `m` and `v` (`<var name>/m`, `<var name>/v`):
    the variable's dtype, float32 for float16 variables.

    Args:
      learning_rate: the step size `lr`, a float; may be changed between steps.
      beta_1: decay of the first-moment estimate `m`, in [0, 1).
      beta_2: decay of the second-moment estimate `v`, in [0, 1).
      epsilon: added to `sqrt(v)` for numerical stability.
      name: names `iterations` and error messages.

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

    def __init__(self, learning_rate: float = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, name: str = "Adam"):
        super().__init__(learning_rate, name)
        self.beta_1 = _hyperparameter(beta_1, "beta_1", "[0, 1)")
        self.beta_2 = _hyperparameter(beta_2, "beta_2", "[0, 1)")
        self.epsilon = _hyperparameter(epsilon, "epsilon")

    def _coefficients(self, dtype, step):  # Keras's casts: powers and lr_t in `dtype`, 1 - beta in Python
        one, t = dtype.type(1), dtype.type(step)
        beta_1_power, beta_2_power = dtype.type(self.beta_1) ** t, dtype.type(self.beta_2) ** t
        lr_t = dtype.type(self.learning_rate) * np.sqrt(one - beta_2_power) / (one - beta_1_power)
        return lr_t, dtype.type(1 - self.beta_1), dtype.type(1 - self.beta_2), dtype.type(self.epsilon)

    def _update_device(self, xp, items, coefficients):
        lr_t, one_minus_beta_1, one_minus_beta_2, epsilon = coefficients
        for var, grad, slots in items:  # on the buffers themselves: shapes and dtypes were checked once per step
            m, v, w = slots[0]._writable(), slots[1]._writable(), var._writable()
            xp.add(m, (grad - m) * one_minus_beta_1, out=m, casting="same_kind")
            xp.add(v, (xp.square(grad) - v) * one_minus_beta_2, out=v, casting="same_kind")
            xp.subtract(w, m * lr_t / (xp.sqrt(v) + epsilon), out=w, casting="same_kind")

    def __repr__(self) -> str:
        return (f"<Adam name={self.name!r} learning_rate={self.learning_rate} beta_1={self.beta_1} "
                f"beta_2={self.beta_2} epsilon={self.epsilon}>")
