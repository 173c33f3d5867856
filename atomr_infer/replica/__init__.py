"""The data plane: ``VllmReplica`` actors, their step loop and per-request streams."""

from atomr_infer.replica.actor import VllmReplica, replica_actor_class
from atomr_infer.replica.request import ChatMessage, Chunk, GenerateRequest, Usage, parse_request
from atomr_infer.replica.stats import ReplicaStats

__all__ = [
    "ChatMessage",
    "Chunk",
    "GenerateRequest",
    "ReplicaStats",
    "Usage",
    "VllmReplica",
    "parse_request",
    "replica_actor_class",
]
