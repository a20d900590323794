"""The exceptions distrib raises, all rooted in DistribError and a matching builtin.

    Exception
    └── DistribError
        ├── DeadlineExceededError  (+ TimeoutError)  a collective waited past its timeout
        ├── CollectiveMismatchError (+ ValueError)   replicas passed different structures/shapes/dtypes
        ├── MergeCallMismatchError (+ RuntimeError)  replicas made different numbers of merge_call calls
        ├── ContextError           (+ RuntimeError)  an API called in the wrong (replica/cross-replica) context
        ├── BackendUnavailableError (+ RuntimeError) the requested backend cannot run here
        ├── CollectiveError        (+ RuntimeError)  NCCL or CUDA failed a collective (communicators aborted)
        ├── ResourceExhaustedError (+ MemoryError)   a device ran out of memory
        ├── KernelCompileError     (+ RuntimeError)  a CUDA kernel failed to compile (NVRTC)
        ├── DeviceError            (+ RuntimeError)  the CUDA runtime or driver reported another error
        ├── CheckpointError        (+ ValueError)    a checkpoint file is damaged, or does not match the objects
        ├── ParameterServerError   (+ RuntimeError)  a parameter server died or cannot be reached
        ├── WorkerError            (+ RuntimeError)  a closure's worker died every time it ran the closure
        ├── WorkerFailedError      (+ RuntimeError)  a rank of a multi-worker job died or the job is being ended
        └── OutOfRangeError        (no builtin)      a scheduled closure read past the end of its input

Wrong kinds of argument raise plain `TypeError`, wrong values plain `ValueError`. Every class but OutOfRangeError
derives from the builtin a TensorFlow user would catch, so `except ValueError` keeps working.
"""

from __future__ import annotations


class DistribError(Exception):
    """Base class of every error distrib raises itself."""


class DeadlineExceededError(DistribError, TimeoutError):
    """A collective did not complete within `CommunicationOptions.timeout_seconds`.

    Attributes:
      missing_replicas: replica ids that never joined the collective.
      operation: name of the collective that timed out.
      missing_ranks: in a multi-worker job, the MPI ranks (processes) that never joined it.
    """

    def __init__(self, message: str, *, missing_replicas: tuple[int, ...] = (), operation: str = "",
                 missing_ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.missing_replicas = tuple(missing_replicas)
        self.operation = operation
        self.missing_ranks = tuple(missing_ranks)


class CollectiveMismatchError(DistribError, ValueError):
    """Replicas passed incompatible values (structure, shape or dtype) to one collective."""


class MergeCallMismatchError(DistribError, RuntimeError):
    """Replicas made different numbers of `merge_call` calls (every collective is one)."""


class ContextError(DistribError, RuntimeError):
    """An API was called in a context where it is not allowed (replica vs cross-replica)."""


class BackendUnavailableError(DistribError, RuntimeError):
    """The backend that was asked for cannot run on this machine; the message says what to install."""


class CollectiveError(DistribError, RuntimeError):
    """The communication library (NCCL) or the CUDA runtime failed a collective.

    The communicators of the devices involved were aborted; the next collective creates new ones, so the
    strategy stays usable once the cause is fixed.

    Attributes:
      operation: name of the collective that failed.
      status: the library's error code (NCCL's ncclResult_t or CUDA's cudaError_t), or None.
    """

    def __init__(self, message: str, *, operation: str = "", status: int | None = None):
        super().__init__(message)
        self.operation = operation
        self.status = status


class ResourceExhaustedError(DistribError, MemoryError):
    """A device ran out of memory (TensorFlow's `ResourceExhaustedError`); the message names the device and size.

    Attributes:
      device: the device that ran out, such as 'GPU:0', or '' when unknown.
    """

    def __init__(self, message: str, *, device: str = ""):
        super().__init__(message)
        self.device = device


class KernelCompileError(DistribError, RuntimeError):
    """A CUDA kernel shipped with distrib failed to compile with NVRTC; the message holds the compiler's log."""


class DeviceError(DistribError, RuntimeError):
    """The CUDA runtime or driver reported an error outside a collective (an illegal address, a lost device).

    Attributes:
      status: CUDA's error code (cudaError_t or CUresult), or None.
    """

    def __init__(self, message: str, *, status: int | None = None):
        super().__init__(message)
        self.status = status


class CheckpointError(DistribError, ValueError):
    """A checkpoint file is corrupt, truncated or not a checkpoint, or it does not match the objects restored."""


class ParameterServerError(DistribError, RuntimeError):
    """A parameter server died or cannot be reached; its variables are lost until restored from a checkpoint.

    Attributes:
      ps_index: which parameter server (its task index in the cluster), or None when unknown.
    """

    def __init__(self, message: str, *, ps_index: int | None = None):
        super().__init__(message)
        self.ps_index = ps_index


class WorkerError(DistribError, RuntimeError):
    """A scheduled closure's worker process died each time it ran it (a crash or out of memory, not an exception)."""


class WorkerFailedError(DistribError, RuntimeError):
    """A rank of a multi-worker job died, or failed before, so the job cannot continue.

    Attributes:
      ranks: the MPI ranks known to have failed (may be empty when the failure was on another host).
    """

    def __init__(self, message: str, *, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.ranks = tuple(ranks)


class OutOfRangeError(DistribError):
    """A scheduled closure called `next()` on an exhausted iterator (TensorFlow's `tf.errors.OutOfRangeError`).

    Not a StopIteration: one raised by `fetch()` inside `map()`, or any `__next__`, would silently end that
    iteration instead of reaching the caller.
    """
