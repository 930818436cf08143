"""Directory: what is global to a pie cluster by its meaning, held in one place (a Ray actor).

- tenant quotas, reserved atomically across replicas: a launch reserves one instance and its page
  quota on its replica before it starts, and the tenant's reservations never pass max_instances
  nor max_kv_pages summed over every replica; program bytes are counted once per tenant;
- replica epochs: each (re)start of a replica joins under a new epoch; joining again ends the
  old life's reservations and exports;
- the export index: (tenant, name) -> the pages each replica holds of it, as the replicas report
  them; the exports of a lost replica are dropped and remembered as lost, with the replica named;
- the tenants' key-value stores (host/messages/hub.py KeyValueStore, bounded by the limits
  the first replica to use one gives), so every replica's instances share one per tenant;
- topics -> subscribed replicas: (tenant, topic) -> the replicas with a subscriber of it, as
  they register them (host/cluster/topics.py); a lost replica's are dropped.
Its state lives in its process only: when Ray restarts it (a new `life`), the fronts `restore`
what they know (replica epochs, their instances' reservations, counted programs, the exports
replicas reported). Plain Python (testable without Ray); `cluster.py` runs it as a Ray actor.
Not thread-safe: a Ray actor runs one call at a time.
"""
from __future__ import annotations

import itertools
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from host.cluster.errors import ReservationError, StaleEpochError
from host.messages.hub import KeyValueStore

__all__ = ["TenantQuota", "Reservation", "Directory", "MAX_LOST_KEPT", "MAX_TOPIC_CHARS"]

MAX_LOST_KEPT = 4096           # lost exports remembered, newest kept
MAX_TOPIC_CHARS = 4096


@dataclass(frozen=True)
class TenantQuota:
    """A tenant's limits over the whole cluster."""

    name: str
    max_instances: int
    max_kv_pages: int
    max_program_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("TenantQuota.name must be a non-empty string")
        for field_name in ("max_instances", "max_kv_pages", "max_program_bytes"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"TenantQuota.{field_name} must be an int >= 0, got {value!r}")


@dataclass(frozen=True)
class Reservation:
    """One instance's reservation: its tenant, replica (and that replica's epoch) and pages."""

    key: str
    tenant: str
    replica_id: str
    epoch: int
    num_pages: int


class Directory:
    """Quotas, epochs and the export index of a cluster. `quotas`: the configured tenants;
    `default_quota`: the limits of a tenant not configured (None: unlimited, for the server's
    own tenants such as the built-in's warm-up)."""

    def __init__(self, quotas: tuple[TenantQuota, ...] = (),
                 default_quota: TenantQuota | None = None) -> None:
        self._quotas = {quota.name: quota for quota in quotas}
        self._default = default_quota
        self._epochs: dict[str, int] = {}
        self._reservations: dict[str, Reservation] = {}
        self._keys = itertools.count()
        self._life = uuid.uuid4().hex
        self._program_bytes: dict[str, dict[str, int]] = {}      # tenant -> sha256 -> size
        self._program_refs: dict[tuple[str, str], list] = {}     # -> [its bytes' ObjectRef]
        self._exports: dict[tuple[str, str], dict[str, int]] = {}  # -> replica -> pages
        self._lost: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._topics: dict[tuple[str, str], set[str]] = {}       # -> subscribed replicas
        self._stores: dict[str, KeyValueStore] = {}

    # ---- lives ------------------------------------------------------------------------------
    def life(self) -> str:
        """This Directory's life: another value once Ray restarted it (its state then empty)."""
        return self._life

    def restore(self, epochs: dict[str, int], reservations: list[Reservation],
                programs: list[tuple[str, str, int, list]],
                exports: dict[str, tuple[int, dict[tuple[str, str], int]]]) -> int:
        """Take back what a front knows after a restart: replicas' epochs (the highest wins),
        its instances' reservations (those of a replica's current epoch, keys kept), programs
        counted (tenant, sha256, size, [its bytes' ObjectRef] or []), the exports each replica
        reported (its epoch, them). Quotas are not checked: what runs, runs. Returns how many
        reservations it took."""
        for replica_id, epoch in epochs.items():
            _check_name("replica_id", replica_id)
            self._epochs[replica_id] = max(self._epochs.get(replica_id, 0), int(epoch))
        taken = 0
        for reservation in reservations:
            if (self._epochs.get(reservation.replica_id) == reservation.epoch
                    and reservation.key not in self._reservations):
                self._reservations[reservation.key] = reservation
                taken += 1
        for tenant, sha256, size, refs in programs:
            self._program_bytes.setdefault(tenant, {}).setdefault(sha256, int(size))
            if refs:
                self._program_refs.setdefault((tenant, sha256), list(refs[:1]))
        for replica_id, (epoch, held) in exports.items():
            self.report_exports(replica_id, epoch, held)
        return taken

    # ---- replicas ---------------------------------------------------------------------------
    def join(self, replica_id: str) -> int:
        """A replica (re)started: its new epoch. What its earlier life held is let go."""
        _check_name("replica_id", replica_id)
        if replica_id in self._epochs:
            self.drop_replica(replica_id)
        epoch = self._epochs.get(replica_id, 0) + 1
        self._epochs[replica_id] = epoch
        return epoch

    def epoch(self, replica_id: str) -> int:
        """The replica's current epoch (0: it never joined)."""
        return self._epochs.get(replica_id, 0)

    def drop_replica(self, replica_id: str, epoch: int | None = None) -> list[str]:
        """The replica's life `epoch` (None: its current one) is lost: free its reservations,
        drop its exports from the index (each remembered as lost with it). Returns one line per
        export lost (held nowhere else); none when a later life has joined since `epoch` (its
        joining let the old life go already)."""
        if epoch is not None and epoch != self._epochs.get(replica_id):
            return []
        for key in [k for k, r in self._reservations.items() if r.replica_id == replica_id]:
            del self._reservations[key]
        for key in [k for k, held in self._topics.items() if replica_id in held]:
            self._unsubscribe(key, replica_id)
        lines = []
        for export_key in [k for k, held in self._exports.items() if replica_id in held]:
            held = self._exports[export_key]
            del held[replica_id]
            if held:
                continue                   # a mirror elsewhere still holds it
            del self._exports[export_key]
            line = f"export {export_key[1]!r} was lost with replica {replica_id}"
            self._lost[export_key] = line
            self._lost.move_to_end(export_key)
            while len(self._lost) > MAX_LOST_KEPT:
                self._lost.popitem(last=False)
            lines.append(line)
        return lines

    # ---- reservations -----------------------------------------------------------------------
    def quota(self, tenant: str) -> TenantQuota | None:
        return self._quotas.get(tenant, self._default)

    def reserve(self, tenant: str, replica_id: str, epoch: int, num_pages: int) -> Reservation:
        """Reserve one instance of `tenant` holding up to `num_pages` on the replica's life
        `epoch`. ReservationError naming the quota when it would pass one; StaleEpochError when
        the replica has restarted since `epoch`."""
        _check_name("tenant", tenant)
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise ReservationError(f"reserve: num_pages must be an int >= 0, got {num_pages!r}")
        if self._epochs.get(replica_id) != epoch:
            raise StaleEpochError(f"replica {replica_id} is at epoch "
                                  f"{self._epochs.get(replica_id, 0)}, not {epoch}")
        quota = self.quota(tenant)
        if quota is not None:
            num_instances, num_reserved = self.usage(tenant)
            if num_instances + 1 > quota.max_instances:
                raise ReservationError(
                    f"tenant {tenant!r}: instance quota: {num_instances} running across the "
                    f"cluster, max_instances is {quota.max_instances}")
            if num_reserved + num_pages > quota.max_kv_pages:
                raise ReservationError(
                    f"tenant {tenant!r}: KV page quota: {num_pages} more pages would pass "
                    f"max_kv_pages ({quota.max_kv_pages}) with {num_reserved} reserved across "
                    f"the cluster")
        reservation = Reservation(f"{self._life[:8]}.{next(self._keys)}", tenant, replica_id,
                                  epoch, num_pages)
        self._reservations[reservation.key] = reservation
        return reservation

    def release(self, key: str) -> bool:
        """Free a reservation; False when it was already freed (or its replica was lost)."""
        return self._reservations.pop(key, None) is not None

    def usage(self, tenant: str) -> tuple[int, int]:
        """(instances, pages) the tenant has reserved across the cluster."""
        mine = [r for r in self._reservations.values() if r.tenant == tenant]
        return len(mine), sum(r.num_pages for r in mine)

    def num_reservations(self) -> int:
        return len(self._reservations)

    # ---- programs ---------------------------------------------------------------------------
    def add_program(self, tenant: str, sha256: str, size: int, refs: list | None = None) -> None:
        """Count a program of `size` bytes against the tenant (once per sha256); `refs`: [the
        ObjectRef of its bytes] (a list, so Ray keeps it a reference), for replicas resolving
        children of it. ReservationError when it would pass max_program_bytes."""
        _check_name("tenant", tenant)
        if refs:
            self._program_refs.setdefault((tenant, sha256), list(refs[:1]))
        held = self._program_bytes.setdefault(tenant, {})
        if sha256 in held:
            return
        quota = self.quota(tenant)
        used = sum(held.values())
        if quota is not None and used + size > quota.max_program_bytes:
            raise ReservationError(f"tenant {tenant!r}: program quota: {size} bytes more would "
                                   f"pass max_program_bytes ({quota.max_program_bytes}); "
                                   f"using {used}")
        held[sha256] = size

    def program_ref(self, tenant: str, sha256: str) -> list:
        """[the ObjectRef of the bytes of the tenant's upload `sha256`], or [] when the tenant
        has no such upload (or its bytes were not registered)."""
        if sha256 not in self._program_bytes.get(tenant, {}):
            return []
        return list(self._program_refs.get((tenant, sha256), []))

    def program_bytes(self, tenant: str) -> int:
        return sum(self._program_bytes.get(tenant, {}).values())

    # ---- exports ----------------------------------------------------------------------------
    def report_exports(self, replica_id: str, epoch: int,
                       exports: dict[tuple[str, str], int]) -> bool:
        """The replica's exports now ((tenant, name) -> pages), replacing what it reported
        before. False (nothing changed) when `epoch` is not the replica's current one."""
        if self._epochs.get(replica_id) != epoch:
            return False
        for export_key in [k for k, held in self._exports.items() if replica_id in held]:
            held = self._exports[export_key]
            del held[replica_id]
            if not held:
                del self._exports[export_key]
        for (tenant, name), num_pages in exports.items():
            self._exports.setdefault((tenant, name), {})[replica_id] = int(num_pages)
            self._lost.pop((tenant, name), None)
        return True

    def held_pages(self, tenant: str, names: tuple[str, ...]) -> dict[str, int]:
        """replica id -> pages it holds of the tenant's exports `names`."""
        held: dict[str, int] = {}
        for name in names:
            for replica_id, num_pages in self._exports.get((tenant, name), {}).items():
                held[replica_id] = held.get(replica_id, 0) + num_pages
        return held

    def holders(self, tenant: str, name: str) -> dict[str, int]:
        """replica id -> pages of the tenant's export `name` (empty: held nowhere)."""
        return dict(self._exports.get((tenant, name), {}))

    def why_missing(self, tenant: str, name: str) -> str | None:
        """Why the tenant's export `name` is held nowhere: the line naming the replica it was
        lost with, or None when it was never seen (or is held)."""
        if (tenant, name) in self._exports:
            return None
        return self._lost.get((tenant, name))


    # ---- tenants' stores ---------------------------------------------------------------------
    def store_get(self, tenant: str, key: str) -> str | None:
        store = self._stores.get(tenant)
        return None if store is None else store.get(key)

    def store_set(self, tenant: str, key: str, value: str, max_keys: int,
                  max_chars: int) -> None:
        """Set `key` in the tenant's store (made with these bounds at its first set);
        LimitError (host.errors) naming the bound it would pass."""
        _check_name("tenant", tenant)
        if not isinstance(key, str) or not isinstance(value, str):
            raise ReservationError("store_set: key and value must be strings")
        store = self._stores.get(tenant)
        if store is None:
            store = self._stores[tenant] = KeyValueStore(int(max_keys), int(max_chars))
        store.set(key, value)

    def store_delete(self, tenant: str, key: str) -> bool:
        store = self._stores.get(tenant)
        return store is not None and store.delete(key)

    # ---- topics -----------------------------------------------------------------------------
    def subscribe_topic(self, tenant: str, topic: str, replica_id: str, epoch: int) -> list[str]:
        """The replica's life `epoch` has a subscriber of the tenant's topic; the other joined
        replicas (to be told). Nothing changes when `epoch` is not the replica's current one."""
        _check_name("tenant", tenant)
        _check_topic(topic)
        if self._epochs.get(replica_id) != epoch:
            return []
        self._topics.setdefault((tenant, topic), set()).add(replica_id)
        return sorted(rid for rid in self._epochs if rid != replica_id)

    def unsubscribe_topic(self, tenant: str, topic: str, replica_id: str,
                          epoch: int) -> list[str]:
        """The replica no longer has a subscriber of the topic; the other joined replicas."""
        if self._epochs.get(replica_id) != epoch:
            return []
        self._unsubscribe((tenant, topic), replica_id)
        return sorted(rid for rid in self._epochs if rid != replica_id)

    def topic_map(self) -> dict[tuple[str, str], list[str]]:
        """(tenant, topic) -> the replicas with a subscriber of it."""
        return {key: sorted(held) for key, held in self._topics.items()}

    def _unsubscribe(self, key: tuple[str, str], replica_id: str) -> None:
        held = self._topics.get(key)
        if held is not None:
            held.discard(replica_id)
            if not held:
                del self._topics[key]


def _check_topic(topic: object) -> None:
    if not isinstance(topic, str) or len(topic) > MAX_TOPIC_CHARS:
        raise ReservationError(f"topic must be a string of at most {MAX_TOPIC_CHARS} "
                               f"characters, got {topic!r:.80}")


def _check_name(what: str, value: object) -> None:
    if not isinstance(value, str) or not value or len(value) > 256:
        raise ReservationError(f"{what} must be a non-empty string of at most 256 characters, "
                               f"got {value!r:.80}")
