"""The one door to Ray: importing it with a clear error, starting or joining a cluster, naming its failures."""

from __future__ import annotations

import os
from typing import Any

from distrib.errors import BackendUnavailableError
from distrib.install_hint import pip_install

def require_ray() -> Any:
    """The `ray` module, or BackendUnavailableError saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise BackendUnavailableError(f"ParameterServerStrategy runs on Ray, which is not installed. Install it "
                                      f"with {pip_install('ps')}.") from exc
    return ray


def ensure_cluster() -> Any:
    """Joins the Ray cluster at `RAY_ADDRESS`, or starts a local one on this machine; returns `ray`.

    A cluster the program started itself with `ray.init(...)` is used as it is.
    """
    ray = require_ray()
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=False)
        else:
            ray.init(include_dashboard=False, log_to_driver=False)
    return ray


def actor_died_errors() -> tuple[type, ...]:
    """The exception types Ray raises when the actor a call went to died (before or during the call)."""
    ray = require_ray()
    return (ray.exceptions.RayActorError,)


def get(refs: Any) -> Any:
    """`ray.get`, with a task's own exception re-raised as itself instead of wrapped in RayTaskError."""
    ray = require_ray()
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as exc:
        cause = exc.as_instanceof_cause()
        original = getattr(exc, "cause", None)
        raise (original if isinstance(original, BaseException) else cause) from None
