"""The Backend protocol: devices, placement, copies, and executing a collective plan over one array per device."""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Callable, Sequence

import numpy as np

from distrib import timeline
from distrib.plan import AllReducePlan, Buffer

# The methods every backend's timeline shows (distrib/timeline.py), and their event category. add_n is the sum onto
# one device of reduce_to, Strategy.reduce and batch_reduce_to in one process (cross_device_ops._reduce_on).
TIMED = {"all_reduce": "collective", "all_gather": "collective", "reduce_scatter": "collective",
         "broadcast": "collective", "add_n": "collective", "pack": "pack", "unpack": "pack", "execute": "plan"}


class Backend(abc.ABC):
    """What the strategy layer needs from an array runtime. Every method is required.

    Collectives take one flat, contiguous 1-D array per device (same length and dtype everywhere, in device
    order) and return new arrays; they never write into their inputs, which may be the user's arrays. Their
    `timeout` bounds how long a collective may take in seconds (None: the backend's default); a backend whose
    collectives cannot hang ignores it.
    """

    name: str = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        timeline.instrument(cls, TIMED)  # wrapped only while a timeline records

    def __new__(cls, *args, **kwargs):
        timeline.check_environment()  # a DISTRIB_TIMELINE that cannot be written: refused before the first collective
        return super().__new__(cls)

    @property
    @abc.abstractmethod
    def xp(self) -> Any:
        """The array module: numpy or cupy."""

    @abc.abstractmethod
    def default_devices(self) -> tuple[str, ...]:
        """Devices a strategy uses when none are named."""

    @abc.abstractmethod
    def check_device(self, device: str) -> None:
        """Raises ValueError if this backend has no such device (a canonical 'GPU:0' / 'CPU:1' name)."""

    @abc.abstractmethod
    def activate(self, device: str) -> None:
        """Makes `device` (and its stream) current in the calling thread; replica threads call it once."""

    @abc.abstractmethod
    def device_scope(self, device: str) -> contextlib.AbstractContextManager[None]:
        """Makes `device` current for a block, restoring the previous device afterwards."""

    @abc.abstractmethod
    def to_device(self, value: Any, device: str) -> Any:
        """`value` (an array of any library, a NumPy scalar or a Python number) as an array on `device`."""

    @abc.abstractmethod
    def to_device_all(self, values: Sequence[Any], device: str) -> list[Any]:
        """`[to_device(v, device) for v in values]`, skipping the work for values already in place."""

    @abc.abstractmethod
    def prefetch_to_device(self, values: Sequence[Any], device: str) -> list[Any]:
        """Input batches for `device`, copied in the background of the device's current work where it can.

        Called from the input pipeline's prefetch thread; the arrays returned are safe to use on `device`'s
        stream without waiting on the host.
        """

    @abc.abstractmethod
    def to_host(self, array: Any) -> np.ndarray:
        """A NumPy array with the same contents."""

    def as_array(self, value: Any) -> Any:
        """`value` as this backend's array or a NumPy one, copying nothing it can read in place (a dataset's
        leaves): by default the host copy; on GPUs, GPU memory stays where it is."""
        return self.to_host(value)

    @abc.abstractmethod
    def empty(self, shape: Sequence[int], dtype: Any, device: str) -> Any:
        """An uninitialised array on `device`."""

    @abc.abstractmethod
    def copy(self, array: Any, device: str) -> Any:
        """A copy of `array` placed on `device`."""

    @abc.abstractmethod
    def pack(self, arrays: Sequence[Any], buffer: Buffer, device: str) -> Any:
        """The buffer's members (given in member order) laid out as one flat array of `buffer.dtype`."""

    @abc.abstractmethod
    def unpack(self, flat: Any, buffer: Buffer) -> list[Any]:
        """The members of a flat buffer as arrays of their shapes, in member order.

        A member of a pack of several is a copy of its own, never a view that keeps the rest of the pack
        alive; the member of a pack of one may be the flat buffer itself.
        """

    def unpack_all(self, flats: Sequence[Any], buffer: Buffer) -> list[list[Any]]:
        """`unpack` of each device's flat buffer of `buffer`; a backend may share work between devices."""
        return [self.unpack(flat, buffer) for flat in flats]

    @abc.abstractmethod
    def execute(self, plan: AllReducePlan, per_device: Sequence[Sequence[Any]], devices: Sequence[str], *,
                timeout: float | None = None) -> list[list[Any]]:
        """Executes a whole batched all-reduce: every buffer of every dtype in `plan`, as one request.

        The contract (what a backend must do, however it schedules the work):
          - `per_device[r][v]` is value v on `devices[r]` (device order, `len(devices) == plan.num_devices`);
            every value appears in exactly one buffer of `plan.packing`, whose members give its shape.
          - Returns `out[r][v]`: on `devices[r]`, with v's shape, the element-wise SUM of value v over the
            devices, or with `plan.mean` the MEAN (float buffers divide in the collective; integer buffers are
            summed, then truly divided, giving floats as TensorFlow does). Inputs are never written.
          - Each buffer is packed in member order and moved chunk by chunk (`buffer.chunks`) as `plan.method`
            says: NATIVE the backend's all-reduce; NCCL the same, and a backend whose collectives are not NCCL
            raises BackendUnavailableError; RING a reduce-scatter then an all-gather; HIERARCHICAL sums chunk k
            on the devices `plan.roots[k]`.
          - The whole plan may be issued at once (one NCCL group over every chunk of every buffer); values
            must equal those of `distrib.backends.packed.execute_pack_by_pack` (bit for bit on the CPU).
          - `timeout` bounds the whole plan in seconds (None: the backend's default).
        """

    @abc.abstractmethod
    def all_reduce(self, flats: Sequence[Any], chunks: Sequence[tuple[int, int]], devices: Sequence[str],
                   mean: bool, *, timeout: float | None = None) -> list[Any]:
        """Element-wise sum (or mean, for float dtypes) across devices, one collective call per chunk."""

    @abc.abstractmethod
    def all_gather(self, flats: Sequence[Any], devices: Sequence[str], *, timeout: float | None = None) -> list[Any]:
        """Each device gets the concatenation of every device's flat array, in device order."""

    def gather_rows(self, rows: np.ndarray, *, timeout: float | None = None) -> np.ndarray:
        """Every replica's row of small host integers, of every process, in global replica order: `rows` holds
        this process's, one int64 row per local replica (an all-gather's value sizes, exchanged before its data).
        Host to host, whatever moves the arrays: one process has nothing to exchange, and returns `rows`."""
        return rows

    @abc.abstractmethod
    def reduce_scatter(self, flats: Sequence[Any], devices: Sequence[str], *,
                       timeout: float | None = None) -> list[Any]:
        """Device i gets a new array: the i-th equal slice of the element-wise sum (length must divide evenly).

        The first phase of RING plans; multi-worker reductions use it too.
        """

    @abc.abstractmethod
    def broadcast(self, array: Any, devices: Sequence[str], *, timeout: float | None = None) -> list[Any]:
        """A copy of `array` on each device."""

    @abc.abstractmethod
    def add_n(self, arrays: Sequence[Any], device: str) -> Any:
        """The element-wise sum of same-shaped arrays, computed on `device` in list order."""

    @abc.abstractmethod
    def fused_optimizer_update(self, rule: str, items: Sequence[tuple[Any, Any, tuple]], coefficients: tuple) -> bool:
        """True if the backend applied an optimizer's update itself (as fused kernels); False if it has none.

        `rule` is "sgd", "momentum", "nesterov" or "adam", whose math and `coefficients` (the step's scalars)
        distrib/optimizers.py defines; `items` are (variable copy, gradient, slot copies) triples. A backend that
        returns True has written the new values into each variable's and slot's `_writable()` buffer (copy on
        write: values read earlier never change); one that returns False has changed nothing.
        """
        return False

    @abc.abstractmethod
    def placed_check(self, devices: Sequence[str]) -> Callable[[Sequence[Any]], bool] | None:
        """For hot paths: a test of whether arrays, one per device of `devices` in order (or several such groups one
        after another: `arrays[i]` on `devices[i % len(devices)]`), are this backend's own arrays on those devices
        already (`to_device` would return each unchanged); None where there is no such test. Not abstract: a
        backend without one takes the general route."""
        return None

    def synchronize(self) -> None:
        """Waits until all queued work on every device is complete."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
