"""Routing by deployment name: routing tables, the load-aware router, and its channels to
replicas (docs/architecture.md)."""
