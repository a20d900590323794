"""Option objects and enums: ReduceOp, CommunicationOptions, CommunicationImplementation, RunOptions, InputOptions."""

from __future__ import annotations

import enum
import math
import numbers
import os
from dataclasses import dataclass, field, replace
from typing import Any


_BY_NAME: dict[tuple[type, str], Any] = {}  # (enum, a valid name as written) -> member


def coerce_enum(cls: type[enum.Enum], value: object, argument: str, *, rule: str = "", by_name: bool = False) -> Any:
    """`value` as a member of the enum `cls`: a member, or its name in any case; with `by_name`, also any
    object whose `.name` is a member's name. Otherwise ValueError stating the rule (by default "`argument`
    must be one of ..."), then what was received.

    Example:
      >>> coerce_enum(ReduceOp, "mean", "reduce_op")
      <ReduceOp.MEAN: 'MEAN'>
    """
    if isinstance(value, cls):
        return value
    if type(value) is str and (member := _BY_NAME.get((cls, value))) is not None:
        return member  # every collective names its op: "SUM" costs a dict look-up
    name = value if isinstance(value, str) else getattr(value, "name", None) if by_name else None
    if isinstance(name, str) and name.upper() in cls.__members__:
        if type(value) is str:
            _BY_NAME[(cls, value)] = cls[name.upper()]
        return cls[name.upper()]
    rule = rule or f"{argument} must be one of {', '.join(cls.__members__)}"
    kind = "" if isinstance(value, str) else f" of type {type(value).__name__}"
    raise ValueError(f"{rule}. Received: {value!r}{kind}.")


class ReduceOp(enum.Enum):
    """How values are combined across replicas: SUM or MEAN.

    Strings are accepted wherever a ReduceOp is, in any case: `"sum"`, `"Mean"`.

    Example:
      >>> ReduceOp.from_value("mean")
      <ReduceOp.MEAN: 'MEAN'>
    """

    SUM = "SUM"
    MEAN = "MEAN"

    __hash__ = object.__hash__  # members are singletons; Enum's own hash is Python code, run by every plan look-up

    @classmethod
    def from_value(cls, value: object) -> "ReduceOp":
        """Converts a ReduceOp, a string naming one, or an enum of the same name (VariableAggregation.SUM,
        TensorFlow's ReduceOp); raises ValueError for any other op."""
        try:
            return _REDUCE_OPS[value]  # every collective names its op: one look-up for a member or a name seen before
        except (KeyError, TypeError):
            op = coerce_enum(cls, value, "reduce_op", rule="Only SUM and MEAN are supported reduce ops", by_name=True)
        if type(value) is str:
            _REDUCE_OPS[value] = op
        return op


_REDUCE_OPS: dict[object, ReduceOp] = {op: op for op in ReduceOp}  # and the names from_value has seen


class CommunicationImplementation(enum.Enum):
    """How NcclAllReduce moves its packs: AUTO (the backend's all-reduce), RING or NCCL.

    RING reduce-scatters each pack, then all-gathers it (the ring algorithm's two phases); NCCL insists on
    NCCL, so on the CPU emulator the first collective raises `BackendUnavailableError`, as TensorFlow fails at
    collective time without GPUs. HierarchicalCopyAllReduce and ReductionToOneDevice keep their own algorithm.
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"

    __hash__ = object.__hash__  # as ReduceOp's: a plan look-up hashes it

    @classmethod
    def from_value(cls, value: object) -> "CommunicationImplementation":
        """Converts a CommunicationImplementation or its name, in any case; raises ValueError for anything else."""
        return coerce_enum(cls, value, "implementation")


@dataclass(frozen=True)
class CommunicationOptions:
    """Options for collectives: packing, timeout and implementation.

    Args:
      bytes_per_pack: values are packed into chunks of at least this many bytes (TensorFlow's rule: a pack is
        closed once it *exceeds* the limit); 0 means one pack per dtype. distrib honours it for every
        cross-device op, not only the collective one, so large models never build one giant buffer.
      timeout_seconds: how long replicas wait at a collective for the others before
        `distrib.errors.DeadlineExceededError`; None uses the strategy default (see the README).
      implementation: a `CommunicationImplementation` or its name, in any case: how NcclAllReduce's packs move.

    Example:
      >>> opts = CommunicationOptions(bytes_per_pack=32 << 20, timeout_seconds=60)
      >>> opts.merge(CommunicationOptions(timeout_seconds=5)).timeout_seconds
      5
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation = field(default=CommunicationImplementation.AUTO)

    def __post_init__(self):
        if isinstance(self.bytes_per_pack, bool) or not isinstance(self.bytes_per_pack, numbers.Integral):
            raise TypeError(f"bytes_per_pack must be an int. Received: {self.bytes_per_pack!r}.")
        if self.bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack must be non-negative. Received: {self.bytes_per_pack}.")
        check_timeout(self.timeout_seconds, "timeout_seconds", zero_ok=True)
        object.__setattr__(self, "bytes_per_pack", int(self.bytes_per_pack))
        object.__setattr__(self, "implementation", CommunicationImplementation.from_value(self.implementation))

    def merge(self, other: "CommunicationOptions | None") -> "CommunicationOptions":
        """A copy of self where each field `other` set away from its default overrides (TensorFlow's rule)."""
        if other is None:
            return self
        if not isinstance(other, CommunicationOptions):
            raise TypeError(f"options must be a CommunicationOptions. Received: {type(other).__name__}.")
        changes = {}
        if other.bytes_per_pack != 0:
            changes["bytes_per_pack"] = other.bytes_per_pack
        if other.timeout_seconds is not None:
            changes["timeout_seconds"] = other.timeout_seconds
        if other.implementation is not CommunicationImplementation.AUTO:
            changes["implementation"] = other.implementation
        return replace(self, **changes) if changes else self

    @property
    def timeout(self) -> float | None:
        """The timeout in seconds, with 0 meaning none."""
        return self.timeout_seconds or None


def check_timeout(value: object, what: str, zero_ok: bool) -> None:
    """TypeError unless `value` is None or a real number; ValueError for NaN, and below zero (or at it)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number or None (seconds). Received: {value!r}.")
    if math.isnan(value) or value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{what} must be {'non-negative' if zero_ok else 'positive'} seconds (inf waits "
                         f"forever). Received: {value!r}.")


DEFAULT_TIMEOUT_SECONDS = 600.0  # how long a collective may wait when no timeout_seconds is given


def default_timeout() -> float:
    """$DISTRIB_COLLECTIVE_TIMEOUT seconds if set, else DEFAULT_TIMEOUT_SECONDS."""
    raw = os.environ.get("DISTRIB_COLLECTIVE_TIMEOUT")
    if raw is None:
        return DEFAULT_TIMEOUT_SECONDS
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"DISTRIB_COLLECTIVE_TIMEOUT must be a number of seconds. Received: {raw!r}.") from None
    if not value > 0:  # NaN too
        raise ValueError(f"DISTRIB_COLLECTIVE_TIMEOUT must be positive (seconds). Received: {raw!r}.")
    return value


REPLICA_EXECUTIONS = ("threads", "cooperative")


def replica_execution(value: str | None) -> str:
    """How a strategy's replicas run: `value`, else $DISTRIB_REPLICA_EXECUTION, else "threads".

    Raises:
      ValueError: for anything but "threads" or "cooperative" (None takes the environment's).
    """
    where, received = "replica_execution", value
    if value is None:  # the environment's in any case and spacing, as DISTRIB_BACKEND is; unset or blank: threads
        where, received = "DISTRIB_REPLICA_EXECUTION", os.environ.get("DISTRIB_REPLICA_EXECUTION", "")
        value = received.strip().lower() or "threads"
    if value not in REPLICA_EXECUTIONS:
        raise ValueError(f"{where} must be 'threads' or 'cooperative'. Received: {received!r}.")
    return value


def replica_execution_is_set() -> bool:
    """Whether $DISTRIB_REPLICA_EXECUTION names a way to run replicas (blank counts as unset)."""
    return bool(os.environ.get("DISTRIB_REPLICA_EXECUTION", "").strip())


@dataclass(frozen=True)
class RunOptions:
    """Options for `Strategy.run`: TensorFlow's fields (they only affect TPUs) and a deadline for the run.

    Args:
      timeout_seconds: the longest one `run` may take, waiting for another thread's run included; past it,
        `distrib.errors.DeadlineExceededError` names the replicas still running and shows their Python stacks.
        None (the default): no limit beyond each collective's own timeout.

    Example:
      >>> import distrib
      >>> strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
      >>> strategy.run(lambda: 1, options=distrib.RunOptions(timeout_seconds=30))
      1
    """

    experimental_enable_dynamic_batch_size: bool = True
    experimental_bucketizing_dynamic_shape: bool = False
    experimental_xla_options: object = None
    timeout_seconds: float | None = None

    def __post_init__(self):
        check_timeout(self.timeout_seconds, "RunOptions.timeout_seconds", zero_ok=False)


class InputReplicationMode(enum.Enum):
    """Whether an input pipeline is built once per worker or once per replica."""

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


class AutoShardPolicy(enum.Enum):
    """How a multi-worker job splits a dataset over its workers (TensorFlow's tf.data AutoShardPolicy).

    AUTO: FILE when the dataset has a `shard(num_shards, index)` method, else DATA. FILE: each worker reads
    `dataset.shard(num_workers, worker_index)`. DATA: every worker reads every global batch and keeps its
    replicas' rows, exactly the rows one process would give them. OFF: every worker reads the whole dataset.

    With FILE and OFF a worker rebatches what it reads as TensorFlow does ("rebatch, then shard"): each batch of
    B rows into `num_replicas_in_sync` pieces of ceil(B / N) rows (the last ones short or empty), its replicas
    taking the next pieces each step. A step then holds one global batch's worth of rows over all the workers'
    replicas, as with DATA; with OFF each worker covers the whole dataset, so an epoch takes num_workers times
    the steps and every row is used once per worker. With one worker every policy splits each batch alike.
    """

    AUTO = "AUTO"
    FILE = "FILE"
    DATA = "DATA"
    OFF = "OFF"


@dataclass(frozen=True)
class InputOptions:
    """Options for distributed input: device prefetch, replication mode, and sharding over workers."""

    experimental_fetch_to_device: bool | None = None  # None: True, as TensorFlow's
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int = 1
    auto_shard_policy: AutoShardPolicy = AutoShardPolicy.AUTO

    def __post_init__(self):
        if self.experimental_fetch_to_device is None:
            object.__setattr__(self, "experimental_fetch_to_device", True)
        if not isinstance(self.experimental_replication_mode, InputReplicationMode):
            raise TypeError("experimental_replication_mode must be an InputReplicationMode. "
                            f"Received: {self.experimental_replication_mode!r}.")
        if not isinstance(self.auto_shard_policy, AutoShardPolicy):
            raise TypeError(f"auto_shard_policy must be an AutoShardPolicy. Received: {self.auto_shard_policy!r}.")
        size = self.experimental_per_replica_buffer_size
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 0:
            raise ValueError(f"experimental_per_replica_buffer_size must be an int >= 0 (0: no prefetching). "
                             f"Received: {size!r}.")

    def check_dataset_placement(self) -> None:
        """What `distribute_datasets_from_function` asks of `experimental_place_dataset_on_device` (checked there, as
        TensorFlow does; `experimental_distribute_dataset` ignores it).

        Raises:
          ValueError: it is True with a replication mode other than PER_REPLICA, or with fetching to device.
        """
        if not self.experimental_place_dataset_on_device:
            return
        if self.experimental_replication_mode is not InputReplicationMode.PER_REPLICA:
            raise ValueError("experimental_place_dataset_on_device=True requires "
                             "experimental_replication_mode=InputReplicationMode.PER_REPLICA (as in TensorFlow).")
        if self.experimental_fetch_to_device:
            raise ValueError("experimental_place_dataset_on_device=True requires experimental_fetch_to_device=False "
                             "(as in TensorFlow).")
