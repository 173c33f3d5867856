"""What an apply will do: classify the change between the recorded and the new spec.

Pure: no Ray. ``plan_apply`` is used by ``manager.apply`` (to report actions) and by
``manager.plan`` / ``atomr deploy --dry-run`` (to show them without changing anything).

Change classes (docs/architecture.md), the rule itself in ``spec.restarts_replicas``:
- in place: ``serving`` (but ``serving.openai``), ``budget``, ``restart_on_apply`` — no replica restarts;
- scale: ``replicas``, or autoscaling bounds that move the running count — start or stop only the difference;
- restart: anything else (model, engine config, gpus, device, vLLM's server options) — rolling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from atomr_infer.control.autoscale import within_bounds
from atomr_infer.errors import SpecError, SpecProblem
from atomr_infer.spec import Deployment, restarts_replicas, spec_changes, spec_hash


@dataclass(frozen=True)
class Action:
    kind: str  # "create" | "unchanged" | "scale" | "roll" | "update_in_place" | "remove" | "noop"
    summary: str  # one line for humans: "scale 2 → 4"
    changes: tuple[str, ...] = ()  # "runtime_config.max_model_len: 2048 → 4096"

    def __str__(self) -> str:
        return self.summary


@dataclass(frozen=True)
class Plan:
    name: str
    changed: bool
    actions: tuple[Action, ...] = field(default_factory=tuple)
    restart: bool = False  # replicas of the old spec must be replaced

    @property
    def summary(self) -> str:
        return "; ".join(a.summary for a in self.actions)


@dataclass(frozen=True)
class ApplyResult:
    """What ``manager.apply`` did."""

    name: str
    changed: bool
    generation: int
    actions: tuple[str, ...]
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class PlanResult:
    """What ``manager.plan`` says an apply would do."""

    name: str
    changed: bool
    actions: tuple[str, ...]
    budget_ok: bool
    budget: str
    error: str | None = None  # the error apply would raise, if any
    scaling: str = ""  # autoscaling bounds and worst-case cost (``scaling_summary``)


def _plural(n: int) -> str:
    return f"{n} replica" + ("" if n == 1 else "s")


def plan_apply(old: Deployment | None, new: Deployment, force_restart: bool = False,
               running: int | None = None) -> Plan:
    """The actions that turn ``old`` (the recorded spec, or None) into ``new``. ``running``: the
    replica count the deployment converges to now (an autoscaled one's target), else ``old.replicas``.
    Autoscaled, ``replicas`` is only the starting count: the target moved within the new bounds runs
    (as ``ManagedDeployment.update`` moves it), and turning autoscaling off runs ``replicas``."""
    if old is None:
        return Plan(new.name, True, (Action("create", f"create {_plural(new.replicas)}"),))
    if spec_hash(old) == spec_hash(new) and not force_restart:
        return Plan(new.name, False, (Action("unchanged", "unchanged"),))
    changes = spec_changes(old, new)
    restart = [c for c in changes if restarts_replicas(c.path)]
    now = old.replicas if running is None else running
    # Autoscaled already: the target stays, within the new bounds; turned on: it starts at ``replicas``.
    then = within_bounds(now if old.autoscaling else new.replicas, new.autoscaling) if new.autoscaling else new.replicas
    counts = [c for c in changes if c.path == "replicas" or c.path.startswith("autoscaling")]
    scale = counts if then != now else []
    in_place = [c for c in changes if c not in restart and c not in scale]
    actions: list[Action] = []
    if restart or force_restart:
        reason = tuple(str(c) for c in restart) or ("restart_on_apply: true",)
        actions.append(Action("roll", f"roll {_plural(min(now, then))} ({', '.join(reason)})", reason))
    if scale:
        why = [("autoscaling on" if c.old is None else "autoscaling off") if c.path == "autoscaling" else str(c)
               for c in scale if c.path != "replicas"]
        actions.append(Action("scale", f"scale {now} → {then}" + (f" ({', '.join(why)})" if why else ""),
                              tuple(str(c) for c in scale)))
    if in_place:
        text = tuple(str(c) + (f" (the starting count; the autoscaler runs {then})"
                               if c.path == "replicas" and new.autoscaling is not None else "") for c in in_place)
        actions.append(Action("update_in_place", f"update in place ({', '.join(text)})", text))
    return Plan(new.name, True, tuple(actions), restart=bool(restart) or force_restart)


def plan_remove(old: Deployment | None, name: str) -> Plan:
    if old is None:
        return Plan(name, False, (Action("noop", f"no deployment named {name!r}; nothing to remove"),))
    return Plan(name, True, (Action("remove", f"drain and remove {_plural(old.replicas)}"),))


_ALIASES = "serving.openai.served_model_name"


def check_names(spec: Deployment, others: list[Deployment]) -> None:
    """A name or alias answers for one deployment only: the OpenAI ``model`` routes by it."""
    taken = {name: other.name for other in others for _, name in other.model_names}
    for given_by, name in spec.model_names:
        if name in taken:
            problem = f"{name!r} already names deployment {taken[name]!r}"
            if taken[name] != name:
                problem += f" (one of its {_ALIASES})"
            raise SpecError([SpecProblem(spec.name, given_by, problem)])
    # "<deployment>:<adapter>" names a deployment's adapter: an alias of that form would take it
    # (an alias routes first), for requests and for the API keys that list the deployment.
    own = {name for _, name in spec.model_names}
    owners = {**taken, **dict.fromkeys(own, spec.name)}
    for alias in spec.serving.openai.served_model_name:
        if ":" in alias and (owner := owners.get(alias.partition(":")[0])):
            raise SpecError([SpecProblem(spec.name, _ALIASES, f"{alias!r} names an adapter of deployment "
                                         f"{owner!r} ('<deployment>:<adapter>'); give the alias no such prefix")])
    for other in others:
        for alias in other.serving.openai.served_model_name:
            if ":" in alias and (base := alias.partition(":")[0]) in own:
                raise SpecError([SpecProblem(spec.name, "name" if base == spec.name else _ALIASES,
                                             f"{base!r}: deployment {other.name!r} has the alias {alias!r}, which "
                                             "would take the name of an adapter of this one")])
    # An adapter's bare name routes to it only where no deployment or alias has the name (they
    # route first, as vLLM refuses an adapter named like a served model): a client of `vllm serve
    # --lora-modules sql=…` sending model 'sql' would get another model, without a word.
    for adapter in spec.lora.adapters if spec.lora else ():
        if adapter in owners:
            raise SpecError([SpecProblem(spec.name, f"lora.adapters.{adapter}", f"{adapter!r} already names "
                                         f"deployment {owners[adapter]!r}, which a request for it would reach: "
                                         "name the adapter otherwise")])
    for other in others:
        for adapter in other.lora.adapters if other.lora else ():
            for given_by, name in spec.model_names:
                if name == adapter:
                    raise SpecError([SpecProblem(spec.name, given_by, f"{name!r} names an adapter of deployment "
                                                 f"{other.name!r}, whose requests it would take")])


def shared_adapter_names(spec: Deployment, others: list[Deployment]) -> list[str]:
    """Warnings for the adapters of ``spec`` another deployment also has: their bare name then
    routes nowhere (which one would it be?), so clients that sent it must name the deployment."""
    shared = {adapter: other.name for other in others for adapter in (other.lora.adapters if other.lora else ())}
    return [f"lora.adapters.{a}: deployment {shared[a]!r} has an adapter {a!r} too, so model {a!r} now names "
            f"neither: send {spec.name + ':' + a!r} or {shared[a] + ':' + a!r}"
            for a in (spec.lora.adapters if spec.lora else ()) if a in shared]
