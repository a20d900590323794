"""The thread-local context stack: which strategy is current, and whether code runs per replica or cross-replica."""

from __future__ import annotations

import functools
import threading
from typing import Any, NamedTuple

from distrib.errors import ContextError

# The strategy layer sits above this module, so strategies and replica contexts are typed `Any` here.


class Frame(NamedTuple):
    """One entry of the stack: the strategy, and the replica context (None when cross-replica)."""

    strategy: Any
    replica_context: Any


# Frame((strategy, replica_context)) without a NamedTuple's Python-level __new__: every run pushes several frames
_new_frame = functools.partial(tuple.__new__, Frame)
_default: list[Frame] = []  # [Frame(default strategy, default replica context)], set by strategy.py
_local = threading.local()


def set_default_frame(frame: Frame) -> None:
    """Installs the default strategy's frame, which every thread's stack starts with."""
    _default[:] = [frame]


def _stack() -> list[Frame]:
    try:
        return _local.stack
    except AttributeError:  # the thread's first look
        stack = _local.stack = list(_default)
        return stack


def set_stack(stack: list[Frame]) -> None:
    """Makes `stack` this thread's stack: each cooperative replica (a greenlet on the calling thread) keeps a
    stack of its own, set whenever it is switched to (`thread_stack` gives the one to put back)."""
    _local.stack = stack


def thread_stack() -> list[Frame]:
    """This thread's stack (the running cooperative replica's, while one runs)."""
    return _stack()


def new_stack() -> list[Frame]:
    """A stack as a new thread starts with: the default frame only."""
    return list(_default)


def current() -> Frame:
    """The innermost frame of this thread."""
    try:
        return _local.stack[-1]  # one call, not two: every run and collective asks, after a transfer has left the
        # caches cold, where each call costs a microsecond or more
    except AttributeError:
        return _stack()[-1]


def is_default(strategy: Any) -> bool:
    return bool(_default) and strategy is _default[0].strategy


def push(strategy: Any, replica_context: Any) -> tuple[list[Frame], int]:
    """Pushes a frame; returns the stack it is on and its depth there, for the caller's `del stack[depth:]` in a
    `finally`.

    `frame` in one call instead of three, for the paths every run takes: right after a transfer has left the
    caches cold, each call costs a microsecond or more. Safe from Ctrl-C, which Python raises only at a call or
    a loop: nothing is called between the push and the caller's `try`, nor in `del stack[depth:]`, which also
    drops any frame above that a Ctrl-C left behind as it landed in a `with frame(...)` block's exit.
    """
    try:
        stack = _local.stack
    except AttributeError:
        stack = _stack()
    depth = len(stack)
    stack += (_new_frame((strategy, replica_context)),)  # not append(): a Ctrl-C can land after a call
    return stack, depth


def push_run(strategy: Any, replica_context: Any) -> tuple[list[Frame], int] | None:
    """`push`es the frame of a run of `strategy` on the calling thread where a run may start as it is: outside any
    strategy's scope, or cross-replica in `strategy`'s. None, pushing nothing, anywhere else (in a replica
    function, in another strategy's scope), where `Strategy.run`'s general path says what to do.

    `current`, the check and `push` in one call: a run of one replica asks right after a transfer has left the
    caches cold. As safe from Ctrl-C as `push`."""
    try:
        stack = _local.stack
    except AttributeError:
        stack = _stack()
    top = stack[-1]
    if top.strategy is not _default[0].strategy and (top.strategy is not strategy or top.replica_context is not None):
        return None
    depth = len(stack)
    stack += (_new_frame((strategy, replica_context)),)
    return stack, depth


class frame:
    """Pushes a frame for the duration of the block (restored even if the block raises).

    A class rather than a generator: every replica enters one per run, and this costs a third as much.

    Args:
      strategy: the strategy made current.
      replica_context: the replica's context, or None for a cross-replica frame.
    """

    __slots__ = ("_frame", "_stack")

    def __init__(self, strategy: Any, replica_context: Any):
        self._frame = _new_frame((strategy, replica_context))

    def __enter__(self) -> None:
        try:
            self._stack = _local.stack
        except AttributeError:
            self._stack = _stack()
        self._stack.append(self._frame)

    def __exit__(self, *exc_info) -> None:
        self._stack.pop()

    def __repr__(self) -> str:
        return f"<context.frame {self._frame}>"


class thread_value:
    """Sets `local.<name>` to `value` for the block (this thread only), restoring the previous value after.

    A class rather than a generator, as `frame` is: every copy of every variable an update writes enters one.

    Args:
      local: the thread-local object.
      name: the attribute set on it.
      value: the value it has inside the block.
    """

    __slots__ = ("_local", "_name", "_value", "_previous")

    def __init__(self, local: threading.local, name: str, value: object):
        self._local, self._name, self._value = local, name, value

    def __enter__(self) -> None:
        self._previous = getattr(self._local, self._name, None)
        setattr(self._local, self._name, self._value)

    def __exit__(self, *exc_info) -> None:
        setattr(self._local, self._name, self._previous)

    def __repr__(self) -> str:
        return f"<context.thread_value {self._name}={self._value!r}>"


def get_strategy() -> Any:
    """The current strategy: the innermost `scope()` or `run()`, else the default (single-replica) strategy.

    Example:
      >>> import distrib
      >>> distrib.get_strategy().num_replicas_in_sync
      1
    """
    return current().strategy


def has_strategy() -> bool:
    """True inside a non-default strategy's `scope()` or `run()`."""
    return not is_default(current().strategy)


def get_replica_context() -> Any:
    """The current `ReplicaContext`, or None in a cross-replica context (inside `scope()` but outside `run()`).

    Outside any strategy this is the default replica context: replica 0 of 1.
    """
    try:
        return _local.stack[-1].replica_context  # as `current`, in one call
    except AttributeError:
        return current().replica_context


def in_cross_replica_context() -> bool:
    """True inside a strategy's `scope()` (or a `merge_call`'s merge_fn) but not inside a replica function."""
    return current().replica_context is None


def get_cross_replica_context() -> Any:
    """The current strategy when in a cross-replica context, else None."""
    top = current()
    return top.strategy if top.replica_context is None else None


def require_cross_replica(api: str, strategy: Any = None, hint: str = "") -> None:
    """The one check that `api` runs in a cross-replica context, and inside no other strategy than `strategy`.

    Raises:
      ContextError (a RuntimeError): called inside a replica function of a non-default strategy.
      ContextError (a RuntimeError): called inside the scope of a strategy other than `strategy`, as TensorFlow
        raises RuntimeError.
    """
    try:
        top = _local.stack[-1]  # `current()` inline: reduce_to and every cross-replica API ask
    except AttributeError:
        top = _stack()[-1]
    default = bool(_default) and top.strategy is _default[0].strategy
    if top.replica_context is not None and not default:
        raise ContextError(f"{api} must be called in a cross-replica context (outside Strategy.run, or in a "
                           f"merge_call's merge_fn), not inside a replica function{'; ' + hint if hint else ''}.")
    if strategy is not None and not default and top.strategy is not strategy:
        raise ContextError(f"Mixing different distrib strategies is not allowed: {api} of {strategy!r} was called "
                         f"inside {top.strategy!r}'s scope.")
