"""The Backend protocol: devices, placement, flat-buffer pack/unpack and collectives over one array per device."""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Iterator, Sequence

import numpy as np

from distrib.plan import Buffer


class Backend(abc.ABC):
    """What the strategy layer needs from an array runtime. Every method is required.

    Collectives take one flat, contiguous 1-D array per device (same length and dtype everywhere, in device
    order) and return new arrays; they never write into their inputs, which may be the user's arrays. Their
    `timeout` bounds how long a collective may take in seconds (None: the backend's default); a backend whose
    collectives cannot hang ignores it.
    """

    name: str = ""

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

    @contextlib.contextmanager
    def device_scope(self, device: str) -> Iterator[None]:
        """Makes `device` current for a block, restoring the previous device afterwards."""
        yield

    @abc.abstractmethod
    def to_device(self, value: Any, device: str) -> Any:
        """`value` (an array of any library, a NumPy scalar or a Python number) as an array on `device`."""

    def to_device_all(self, values: Sequence[Any], device: str) -> list[Any]:
        """`[to_device(v, device) for v in values]`; backends may skip work for values already in place."""
        return [self.to_device(v, device) for v in values]

    def prefetch_to_device(self, values: Sequence[Any], device: str) -> list[Any]:
        """Input batches for `device`, copied in the background of the device's current work where it can.

        Called from the input pipeline's prefetch thread; the arrays returned are safe to use on `device`'s
        stream without waiting on the host. By default the same as `to_device_all`.
        """
        return self.to_device_all(values, device)

    @abc.abstractmethod
    def to_host(self, array: Any) -> np.ndarray:
        """A NumPy array with the same contents."""

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
        """The members of a flat buffer as arrays of their shapes, in member order."""

    @abc.abstractmethod
    def all_reduce(self, flats: Sequence[Any], chunks: Sequence[tuple[int, int]], devices: Sequence[str],
                   mean: bool, *, timeout: float | None = None) -> list[Any]:
        """Element-wise sum (or mean, for float dtypes) across devices, one collective call per chunk."""

    @abc.abstractmethod
    def all_gather(self, flats: Sequence[Any], devices: Sequence[str], *, timeout: float | None = None) -> list[Any]:
        """Each device gets the concatenation of every device's flat array, in device order."""

    @abc.abstractmethod
    def reduce_scatter(self, flats: Sequence[Any], devices: Sequence[str], *,
                       timeout: float | None = None) -> list[Any]:
        """Device i gets the i-th equal slice of the element-wise sum (length must divide evenly)."""

    @abc.abstractmethod
    def broadcast(self, array: Any, devices: Sequence[str], *, timeout: float | None = None) -> list[Any]:
        """A copy of `array` on each device."""

    @abc.abstractmethod
    def add_n(self, arrays: Sequence[Any], device: str) -> Any:
        """The element-wise sum of same-shaped arrays, computed on `device` in list order."""

    def fused_optimizer_update(self, rule: str, items: Sequence[tuple[Any, Any, tuple]], coefficients: tuple) -> bool:
        """True if the backend applied an optimizer's update itself (e.g. as fused kernels); by default False.

        `rule` is "sgd", "momentum", "nesterov" or "adam", whose math and `coefficients` (the step's scalars)
        distrib/optimizers.py defines; `items` are (variable copy, gradient, slot copies) triples. A backend that
        returns True has written the new values into each variable's and slot's `_writable()` buffer (copy on
        write: values read earlier never change); one that returns False has changed nothing.
        """
        return False

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Waits until all queued work on every device is complete."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
