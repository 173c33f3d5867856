"""The data plane's actor: ``VllmReplica``, its lifecycle and its channels to the routers."""

from atomr_infer.engine.stats import ReplicaStats
from atomr_infer.replica.actor import VllmReplica, replica_actor_class
from atomr_infer.replica.lifecycle import ReplicaHealth

__all__ = ["ReplicaHealth", "ReplicaStats", "VllmReplica", "replica_actor_class"]
