"""ClusterStore: a tenant's key-value store as a replica's instances see it in `pie serve
--ray`: held by the Directory (one per tenant across the cluster), each get / set / delete one
call of it from the instance's thread. Bounded there by the replica's MessageLimits; a set
past a bound raises LimitError as the local store does; a Directory that does not answer
traps the calling instance naming it."""
from __future__ import annotations

from typing import Any

from ray.exceptions import GetTimeoutError, RayActorError

from host.cluster.ray_calls import answer
from host.errors import TrapError
from host.runtime_config import MessageLimits

__all__ = ["ClusterStore"]

_CALL_TIMEOUT_S = 10.0


class ClusterStore:
    """The store of `tenant` in the Directory actor `directory`."""

    def __init__(self, directory: Any, limits: MessageLimits, tenant: str) -> None:
        self._directory = directory
        self._limits = limits
        self.tenant = tenant

    def get(self, key: str) -> str | None:
        return self._ask("store_get", "messaging.store-get", self.tenant, key)

    def set(self, key: str, value: str) -> None:
        self._ask("store_set", "messaging.store-set", self.tenant, key, value,
                  self._limits.store_max_keys, self._limits.store_max_chars)

    def delete(self, key: str) -> bool:
        return self._ask("store_delete", "messaging.store-delete", self.tenant, key)

    def _ask(self, method: str, call: str, *args: Any) -> Any:
        try:
            return answer(getattr(self._directory, method).remote(*args), _CALL_TIMEOUT_S)
        except (RayActorError, GetTimeoutError) as exc:
            raise TrapError(f"{call}: the cluster's directory, which holds the tenant's store, "
                            f"is not answering ({type(exc).__name__})") from None
