"""Destinations of reduce_to and broadcast_to: a device name, an array, a distributed value or variable, as devices."""

from __future__ import annotations

from typing import Any

import numpy as np

from distrib.devices import HOST, canonical_name
from distrib.distributed_variables import DistributedVariable
from distrib.values import DistributedValues, PerReplica
from distrib.variables import Variable


def resolve_destinations(destinations: Any, devices: tuple[str, ...]) -> tuple[str, ...]:
    """The device names `destinations` stands for, among a strategy's `devices` (or ('host',), the host CPU)."""
    if type(destinations) is PerReplica and len(destinations._values) == len(devices):
        return devices  # the usual destinations: the value itself (one check per value of a batch)
    if destinations is None:
        raise ValueError("destinations must be a device name, an array, a distributed value or a distributed "
                         "variable. Received: None.")
    if isinstance(destinations, (list, tuple)):
        raise ValueError(f"destinations can not be a list or tuple; pass a device name or a distributed value. "
                         f"Received: {destinations!r}.")
    if isinstance(destinations, str):
        if destinations == HOST:
            return (HOST,)
        name = canonical_name(destinations)
        if name in devices:
            return (name,)
        if name == "CPU:0":  # the host CPU, when it is not one of the replicas' devices
            return (HOST,)
        host = "or 'host'" if "CPU:0" in devices else "'CPU:0' or 'host'"  # CPU:0 is the host CPU or a replica
        raise ValueError(f"Unknown destination {destinations!r}: expected one of the strategy's devices "
                         f"{devices}, {host} for the host CPU.")
    if isinstance(destinations, DistributedVariable):
        return destinations.devices
    if isinstance(destinations, Variable):  # a plain variable (the default strategy's): its device
        return resolve_destinations(destinations.device, devices)
    if isinstance(destinations, DistributedValues):
        if len(destinations.values) == len(devices):
            return devices
        if len(destinations.values) == 1:  # one component (a reduction's result on one device): its device
            return resolve_destinations(destinations.values[0], devices)
        raise ValueError(f"destinations has {len(destinations.values)} components but the strategy has "
                         f"{len(devices)} replicas.")
    if hasattr(destinations, "__dlpack_device__"):
        return resolve_destinations(_array_device(destinations), devices)  # an array: its device, as in TensorFlow
    if isinstance(destinations, np.generic):  # a NumPy scalar (a lone replica's value in a merge_call): host memory
        return resolve_destinations("CPU:0", devices)
    raise TypeError(f"destinations must be a device name, an array, a distributed value or a distributed "
                    f"variable. Received: {type(destinations).__name__}.")


_DLPACK_CUDA = 2  # DLPack's kDLCUDA; kDLCPU (1) and pinned host memory (3) are the host CPU


def _array_device(array: Any) -> str:
    """The device name of an array, from its DLPack device: 'GPU:k' for CUDA memory, else 'CPU:0'."""
    kind, index = array.__dlpack_device__()
    return f"GPU:{index}" if int(kind) == _DLPACK_CUDA else "CPU:0"
