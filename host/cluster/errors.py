"""The errors of a pie cluster: what a replica, the directory or the front refuses, and why."""
from __future__ import annotations

__all__ = ["ClusterError", "StaleEpochError", "ReservationError", "ReplicaLostError"]


class ClusterError(Exception):
    """A request the cluster refuses; the message names the cause and the limit."""


class StaleEpochError(ClusterError):
    """A call made for an earlier life of a replica: the replica restarted since, and what the
    call named (an instance, a reservation) ended with that life."""


class ReservationError(ClusterError):
    """A tenant's launch or upload would pass one of its quotas across the whole cluster."""


class ReplicaLostError(ClusterError):
    """The replica holding an instance (or asked to take one) is gone."""
