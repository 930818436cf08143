"""The answer of a Ray call to one of the cluster's actors, raising the actor's own exception."""
from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import RayTaskError

__all__ = ["answer"]


def answer(ref: Any, timeout_s: float) -> Any:
    """`ray.get(ref)` within `timeout_s`; what the actor raised is raised as it was (its message,
    not Ray's traceback). RayActorError (the actor is gone) and GetTimeoutError pass through."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except RayTaskError as exc:
        if isinstance(exc.cause, Exception):
            raise exc.cause from None
        raise
