"""The control plane: the DeploymentManager actor, its reconcile loop, plans, budgets and
recorded state (docs/architecture.md)."""
