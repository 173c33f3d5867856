"""The error tree of atomr-infer.

Every error the project raises on purpose is an ``AtomrError``. They cross Ray actor
boundaries, so each one passes *all* of its constructor arguments to
``super().__init__`` (ray-project/ray#50211): ``cls(*self.args)`` must rebuild it.
HTTP status codes are attached only in the ingress (``serve/``), never here.

    AtomrError
    ├── SpecError                   a deployment spec is invalid (one or many problems)
    ├── ModelError                  a model cannot be resolved or prepared
    ├── BudgetExceeded              GPUs, memory or spend over a limit; nothing was started
    ├── DeviceUnavailable           the deployment's device (CUDA) is not usable on this host/cluster
    ├── NoCluster                   nothing listens where a Ray cluster was looked for
    ├── RequestError                a request is bad; the replica keeps serving others
    │   ├── InvalidRequest          names the offending field
    │   └── RequestTooLarge         the body is over the ingress's size limit
    ├── RoutingError
    │   ├── DeploymentNotFound      no deployment by that name
    │   │   └── AdapterNotFound     the deployment has no such LoRA adapter
    │   │       └── AdapterFailed   every ready replica failed to load it
    │   ├── NoReadyReplica          the deployment exists but nothing is ready to serve
    │   │   └── AdapterNotLoaded    ready replicas, but none has the LoRA adapter loaded (yet)
    │   ├── RouterClosed            the router (a ``Client``'s) was closed under the request
    │   └── CapacityExhausted       serving.max_concurrent reached with on_capacity_exhausted=reject
    └── EngineError                 the engine failed; open streams receive it
        ├── EngineStartFailed       the engine raised while starting (recurring unless a network error)
        └── ReplicaUnavailable      the replica is draining, stopped or unhealthy
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


class AtomrError(Exception):
    """Base of every error atomr-infer raises on purpose."""

    #: Whether retrying the same call later may succeed (capacity, readiness).
    retryable: bool = False


@dataclass(frozen=True)
class SpecProblem:
    """One problem in one spec: where it is and what is wrong."""

    source: str  # file path, or "<dict>"
    field: str  # dotted path, e.g. "runtime_config.max_model_len"; "" for the whole document
    message: str

    def __str__(self) -> str:
        where = f"{self.source}: {self.field}" if self.field else self.source
        return f"{where}: {self.message}"


class SpecError(AtomrError):
    """One or more deployment specs are invalid. ``problems`` lists each one."""

    def __init__(self, problems: list[SpecProblem] | tuple[SpecProblem, ...]) -> None:
        super().__init__(list(problems))
        self.problems: list[SpecProblem] = list(problems)

    def __str__(self) -> str:
        return "; ".join(str(p) for p in self.problems)


class ModelError(AtomrError):
    """A model reference cannot be resolved, found or prepared."""

    def __init__(self, model: str, message: str, hint: str = "", kind: str = "model") -> None:
        super().__init__(model, message, hint)
        self.model, self.message, self.hint, self.kind = model, message, hint, kind  # kind: "model" | "adapter"

    def __str__(self) -> str:
        return f"{self.kind} {self.model!r}: {self.message}" + (f" (hint: {self.hint})" if self.hint else "")


class BudgetExceeded(AtomrError):
    """A budget check failed before anything was created.

    ``check`` is ``"gpus"``, ``"memory"`` or ``"spend"``; ``requested`` and ``available`` carry
    the numbers in ``unit`` so a caller can render them.
    """

    def __init__(
        self,
        deployment: str,
        check: str,
        requested: float,
        available: float,
        unit: str,
        hint: str = "",
    ) -> None:
        super().__init__(deployment, check, requested, available, unit, hint)
        self.deployment, self.check = deployment, check
        self.requested, self.available, self.unit, self.hint = requested, available, unit, hint

    def __str__(self) -> str:
        msg = (
            f"deployment {self.deployment!r} over its {self.check} budget: "
            f"needs {self.requested:g} {self.unit}, {self.available:g} {self.unit} available"
        )
        return msg + (f" (hint: {self.hint})" if self.hint else "")


# What to do without a GPU: the one place library code names the repository's CPU demo spec.
CPU_DEMO_HINT = "use deployments/smollm2.yaml (device: cpu) on a host without a GPU"


class DeviceUnavailable(AtomrError):
    """The device a deployment asks for is not there (e.g. ``device: cuda`` with no GPU)."""

    def __init__(self, deployment: str, reason: str, hint: str = CPU_DEMO_HINT) -> None:
        super().__init__(deployment, reason, hint)
        self.deployment, self.reason, self.hint = deployment, reason, hint

    def __str__(self) -> str:
        msg = f"deployment {self.deployment!r} cannot run here: {self.reason}"
        return msg + (f" (hint: {self.hint})" if self.hint else "")


class SettingError(AtomrError):
    """An environment setting atomr reads is not valid (the CLI exits 2: invalid input)."""


class NoCluster(AtomrError):
    """No Ray cluster runs where one was looked for: nothing listens there. Distinct from a
    cluster that answers but cannot be joined (a timeout, a missing auth token), which ``atomr
    down`` must not take for "nothing to stop"."""


class RequestError(AtomrError):
    """A request cannot be served as given. Other requests are unaffected."""


class InvalidRequest(RequestError):
    """A request field has a bad value. ``field`` names it (OpenAI's ``param``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(field, message)
        self.field, self.message = field, message

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class RequestTooLarge(RequestError):
    """A request body over the ingress's limit, refused before it is read to the end."""

    field = "body"

    def __init__(self, limit: int, size: int | None = None) -> None:
        super().__init__(limit, size)
        self.limit, self.size = limit, size

    @property
    def message(self) -> str:
        sent = f" ({self.size} bytes sent)" if self.size is not None else ""
        return f"the request body is over the limit of {self.limit} bytes{sent}"

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class RoutingError(AtomrError):
    """A request could not be routed to a replica."""


class DeploymentNotFound(RoutingError):
    """``known``: the deployments to name in the message; None names none (said to a caller
    without an API key, who may not learn them)."""

    def __init__(self, name: str, known: list[str] | tuple[str, ...] | None = (),
                 adapter_of: list[str] | tuple[str, ...] = ()) -> None:
        super().__init__(name, None if known is None else list(known), list(adapter_of))
        self.name, self.known = name, None if known is None else list(known)
        self.adapter_of = list(adapter_of)  # deployments that each have an adapter of this bare name

    def __str__(self) -> str:
        if self.known is None:
            return f"no deployment named {self.name!r}"
        known = ", ".join(self.known) if self.known else "none"
        shared = ""
        if self.adapter_of:  # a bare adapter name is ambiguous: which deployment's?
            shared = (f"; {self.name!r} is an adapter of {' and '.join(self.adapter_of)}: send "
                      + " or ".join(repr(f"{d}:{self.name}") for d in self.adapter_of))
        return f"no deployment named {self.name!r} (deployments: {known}{shared})"

    def unlisted(self) -> DeploymentNotFound:
        """The same error naming nothing the request did not: for a caller without an API key."""
        return DeploymentNotFound(self.name, None)


class AdapterNotFound(DeploymentNotFound):
    """A ``"<deployment>:<adapter>"`` whose deployment has no such LoRA adapter (404, as a model).
    ``known``: its adapters; None names none."""

    def __init__(self, deployment: str, adapter: str, known: list[str] | tuple[str, ...] | None = ()) -> None:
        super().__init__(f"{deployment}:{adapter}", known)
        self.deployment, self.adapter = deployment, adapter
        self.args = (deployment, adapter, self.known)  # unpickled as AdapterNotFound(*args), as the others are

    def __str__(self) -> str:
        if self.known is None:
            return f"deployment {self.deployment!r} has no adapter {self.adapter!r}"
        known = ", ".join(self.known) if self.known else "none"
        return f"deployment {self.deployment!r} has no adapter {self.adapter!r} (its adapters: {known})"

    def unlisted(self) -> AdapterNotFound:
        return AdapterNotFound(self.deployment, self.adapter, None)


class AdapterFailed(AdapterNotFound):
    """Every ready replica of the deployment failed to load the adapter: a request for it fails at
    once, saying why (404, as vLLM answers for a model it does not serve), instead of waiting."""

    def __init__(self, deployment: str, adapter: str, why: str | None) -> None:
        super().__init__(deployment, adapter)
        self.why = why  # None: not said (it may name the server's paths)
        self.args = (deployment, adapter, why)  # unpickled as AdapterFailed(*args), as the others are

    def __str__(self) -> str:
        why = "" if self.why is None else f": {self.why}"
        return (f"adapter {self.adapter!r} of deployment {self.deployment!r} failed to load on every ready replica"
                f"{why} (hint: `atomr status {self.deployment}`; applying the spec again tries it at once)")

    def unlisted(self) -> AdapterFailed:
        return AdapterFailed(self.deployment, self.adapter, None)


class ResponseNotFound(RoutingError):
    """A stored response whose replica is gone, and no replica is up to say so: 404 at once (as
    vLLM's own, for an id it does not hold), not a wait for a replica (a cold start)."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id

    def __str__(self) -> str:
        return f"Response with id '{self.response_id}' not found."


class NoReadyReplica(RoutingError):
    retryable = True

    def __init__(self, name: str, waited_s: float = 0.0) -> None:
        super().__init__(name, waited_s)
        self.name, self.waited_s = name, waited_s

    def __str__(self) -> str:
        return f"deployment {self.name!r} has no ready replica (waited {self.waited_s:.1f}s)"


class AdapterNotLoaded(NoReadyReplica):
    """The deployment has ready replicas but none has loaded the adapter by the end of the router's
    wait (still loading it, most often): 503 with Retry-After, as ``NoReadyReplica``."""

    def __init__(self, deployment: str, adapter: str, ready: int, waited_s: float = 0.0, loading: bool = True) -> None:
        super().__init__(f"{deployment}:{adapter}", waited_s)
        self.deployment, self.adapter, self.ready, self.loading = deployment, adapter, ready, loading
        self.args = (deployment, adapter, ready, waited_s, loading)  # unpickled as AdapterNotLoaded(*args)

    def __str__(self) -> str:
        where = "its ready replica" if self.ready == 1 else f"any of its {self.ready} ready replicas"
        still = "still loading; " if self.loading else ""
        return (f"adapter {self.adapter!r} of deployment {self.deployment!r} is not loaded on {where} "
                f"({still}waited {self.waited_s:.0f}s)")


class CapacityExhausted(RoutingError):
    retryable = True

    def __init__(self, name: str, max_concurrent: int, retry_after_s: float = 1.0) -> None:
        super().__init__(name, max_concurrent, retry_after_s)
        self.name, self.max_concurrent, self.retry_after_s = name, max_concurrent, retry_after_s

    def __str__(self) -> str:
        return (
            f"deployment {self.name!r} is at capacity "
            f"(serving.max_concurrent={self.max_concurrent} per replica, on_capacity_exhausted=reject)"
        )


class RouterClosed(RoutingError):
    """The router was closed (``Client.aclose``) while the request was open: it just ends; no
    replica failed."""


class ReplicaBusy(RoutingError):
    """A replica refused a request at its own limit; the router counts it as full and routes again."""

    retryable = True

    def __init__(self, replica: str, limit: int) -> None:
        super().__init__(replica, limit)
        self.replica, self.limit = replica, limit

    def __str__(self) -> str:
        return f"{self.replica} is at its limit of {self.limit} concurrent requests (serving.max_concurrent)"


class EngineQueueFull(ReplicaBusy):
    """A replica's engine refused a request with vLLM's 503 (its queue full: ``max_num_queued_reqs``
    or ``max_num_queued_tokens``): routed again like ``ReplicaBusy``, but as a try of its own (a
    request vLLM refuses every time, more choices than the queue holds, gets its 503 in the end)."""


class EngineError(AtomrError):
    """The engine failed. Every open stream of the replica receives this error."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class EngineStartFailed(EngineError):
    """The engine raised while it was being built. ``recurring``: starting again with the same
    spec will fail the same way (a bad config, too little memory), so retrying is pointless."""

    def __init__(self, message: str, recurring: bool = True) -> None:
        AtomrError.__init__(self, message, recurring)  # every argument, so it unpickles
        self.message, self.recurring = message, recurring


class ReplicaUnavailable(EngineError):
    """The replica is not accepting requests (draining, stopped or unhealthy)."""

    retryable = True


def unwrap(exc: BaseException) -> BaseException:
    """The error a Ray task raised, without Ray's ``RayTaskError`` wrapper (and its remote traceback)."""
    ray_exceptions = sys.modules.get("ray.exceptions")  # not imported: ``exc`` cannot be Ray's
    wrapped = ray_exceptions is not None and isinstance(exc, ray_exceptions.RayTaskError)
    cause = getattr(exc, "cause", None)
    return cause if wrapped and isinstance(cause, BaseException) else exc


def one_line(exc: BaseException) -> str:
    """The last non-empty line of ``exc``'s text (Ray's errors carry tracebacks before it)."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else type(exc).__name__
