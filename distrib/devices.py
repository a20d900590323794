"""Device names: parse TensorFlow-style device strings into a canonical 'CPU:0' / 'GPU:1' form."""

from __future__ import annotations

import re
from typing import NamedTuple

_DEVICE_RE = re.compile(
    r"^(?:/job:[^/]+)?(?:/replica:\d+)?(?:/task:\d+)?(?:/?device:)?/?(?P<kind>cpu|gpu)(?::(?P<index>\d+))?$",
    re.IGNORECASE,
)

HOST = "host"


class Device(NamedTuple):
    """A parsed device: its kind ('CPU' or 'GPU') and index."""

    kind: str
    index: int

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}"


def parse_device(spec: object) -> Device:
    """Parses 'GPU:1', '/gpu:1', '/device:GPU:1' or '/job:localhost/replica:0/task:0/device:GPU:1'.

    Raises:
      TypeError: `spec` is not a string.
      ValueError: `spec` names no CPU or GPU device.
    """
    if isinstance(spec, Device):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"A device must be a string such as 'GPU:0' or 'CPU:1'. Received: {spec!r} "
                        f"of type {type(spec).__name__}.")
    match = _DEVICE_RE.match(spec.strip())
    if match is None:
        raise ValueError(f"Unknown device {spec!r}: distrib understands CPU and GPU devices written as 'GPU:0', "
                         f"'/gpu:0' or '/job:localhost/replica:0/task:0/device:GPU:0'.")
    return Device(match["kind"].upper(), int(match["index"] or 0))


def canonical_name(spec: object) -> str:
    """The canonical short name of a device spec, e.g. '/device:GPU:1' -> 'GPU:1'."""
    return str(parse_device(spec))
