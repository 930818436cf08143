"""A replica's SpawnHooks (host/spawns.py): children.spawn in `pie serve --ray`.

- resolve: a program of the parent's tenant only, by the sha256 of its upload, as the
  Directory's program index knows it (every front registers each upload it counts, with its
  bytes in Ray's object store); compiled here at the first child of it, then cached. A name,
  another tenant's upload, or one whose bytes are no longer reachable is refused, named.
- admit: the child reserves one instance and its page quota in the Directory, on this
  replica, like a launch (the tenant's quotas across the cluster); freed when the child ends.
"""
from __future__ import annotations

import re
from typing import Any, Callable

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from host.cluster.ray_calls import answer
from host.runtime import SpawnHooks
from host.runtime_config import InstanceLimits
from host.sandbox.programs import Program

__all__ = ["cluster_spawn_hooks"]

_SHA256 = re.compile(r"[0-9a-f]{64}")
_CALL_TIMEOUT_S = 10.0


def cluster_spawn_hooks(replica_id: str, epoch: int, directory: Any,
                        programs: Any, load_program: Callable[[bytes], Program]) -> SpawnHooks:
    """The hooks of replica `replica_id` (life `epoch`): `programs` its ProgramCache,
    `load_program(bytes)` its Runtime's."""

    def resolve(tenant: str, program: str) -> Program:
        if not isinstance(program, str) or not _SHA256.fullmatch(program):
            raise LookupError(f"no upload of tenant {tenant!r} has the sha256 {program!r:.80}")
        refs = _ask(directory.program_ref.remote(tenant, program))
        if not refs:
            raise LookupError(f"no upload of tenant {tenant!r} has the sha256 {program!r}")
        try:
            return programs.get(program)
        except KeyError:
            pass
        try:
            data = ray.get(refs[0], timeout=_CALL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 -- owner gone, object lost: named below
            raise LookupError(f"upload {program} of tenant {tenant!r} is not reachable from "
                              f"replica {replica_id} (its front is gone?): "
                              f"{type(exc).__name__}") from None
        return load_program(bytes(data))

    def admit(tenant: str, limits: InstanceLimits) -> Callable[[], None]:
        reservation = _ask(directory.reserve.remote(tenant, replica_id, epoch,
                                                    limits.page_quota or 0))

        def release() -> None:
            directory.release.remote(reservation.key)
        return release

    return SpawnHooks(resolve=resolve, admit=admit)


def _ask(ref: Any) -> Any:
    """A Directory call's answer; what it raised, as raised; RuntimeError when it is gone."""
    try:
        return answer(ref, _CALL_TIMEOUT_S)
    except (RayActorError, GetTimeoutError) as exc:
        raise RuntimeError(f"the cluster's directory is not answering: "
                           f"{type(exc).__name__}") from None
