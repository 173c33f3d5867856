"""Turn YAML files, directories and dicts into validated ``Deployment`` objects.

Every problem in every input is collected before anything is raised, so ``atomr validate``
can print them all at once, one line each: ``<file>: <field path>: <message>``.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from atomr_infer.errors import SpecError, SpecProblem
from atomr_infer.spec.base import FieldValueError
from atomr_infer.spec.deployment import Deployment

YAML_SUFFIXES = (".yaml", ".yml")
Source = str | Path | Mapping[str, Any] | Deployment


def parse_deployment(obj: Mapping[str, Any] | Deployment, source: str = "<dict>") -> Deployment:
    """Validate one mapping, or a ``Deployment`` (one made by ``model_copy(update=...)`` was
    never validated). Raises ``SpecError``."""
    if isinstance(obj, Deployment):
        obj = obj.model_dump(exclude_unset=True, warnings=False)  # a wrong type is said below
    if not isinstance(obj, Mapping):
        raise SpecError([SpecProblem(source, "", f"expected a mapping of deployment fields, got {_kind(obj)}")])
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", FutureWarning)
            deployment = Deployment.model_validate(dict(obj))
    except ValidationError as exc:
        raise SpecError([_problem(source, err) for err in exc.errors()]) from None
    for w in caught:  # a deprecated field name: said again with the file it is in
        warnings.warn(f"{source}: {w.message}", w.category, stacklevel=2)
    return deployment


def load_deployments(*sources: Source) -> list[Deployment]:
    """Load deployments from files, directories (their ``*.yaml``/``*.yml``), dicts or specs.

    Raises ``SpecError`` listing every problem, including names (or aliases) used twice across the input.
    """
    found: list[tuple[str, Deployment]] = []
    problems: list[SpecProblem] = []
    for src in sources:
        for where, doc in _documents(src, problems):
            try:
                found.append((where, parse_deployment(doc, where)))
            except SpecError as exc:
                problems.extend(exc.problems)
    first_seen: dict[str, tuple[int, str]] = {}  # a name or alias -> the deployment that gave it first
    for i, (where, dep) in enumerate(found):
        for field, value in dep.model_names:
            seen = first_seen.setdefault(value, (i, where))
            if seen[0] != i:  # the OpenAI `model` routes by it: one deployment each
                problems.append(SpecProblem(where, field, f"{value!r} is already used by {seen[1]}"))
    if problems:
        raise SpecError(problems)
    return [dep for _, dep in found]


def _documents(src: Source, problems: list[SpecProblem]) -> Iterable[tuple[str, Any]]:
    if isinstance(src, Mapping):
        yield "<dict>", anchored(src, Path.cwd())
        return
    if isinstance(src, Deployment):
        yield "<dict>", src
        return
    path = Path(src)
    if path.is_dir():
        files = sorted(
            p for p in path.rglob("*")
            if p.suffix.lower() in YAML_SUFFIXES and p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(path).parts)  # .git, .venv, ...
        )
        if not files:
            problems.append(SpecProblem(str(path), "", "directory has no *.yaml or *.yml files"))
        for f in files:
            yield from _file_documents(f, problems)
    else:
        yield from _file_documents(path, problems)


def _file_documents(path: Path, problems: list[SpecProblem]) -> Iterable[tuple[str, Any]]:
    if path.exists() and not path.is_file():  # a FIFO or a device: reading it could wait forever
        problems.append(SpecProblem(str(path), "", "not a regular file or a directory"))
        return
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        problems.append(SpecProblem(str(path), "", "no such file or directory"))
        return
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(SpecProblem(str(path), "", f"cannot read file: {exc}"))
        return
    try:
        docs = [(i, d) for i, d in enumerate(yaml.load_all(text, Loader=_UniqueKeyLoader)) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        reason = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        problems.append(SpecProblem(str(path), "", f"invalid YAML{where}: {reason}"))
        return
    if not docs:
        problems.append(SpecProblem(str(path), "", "file is empty: expected a deployment (name, model, ...)"))
        return
    for i, doc in docs:  # numbered as they are in the file, empty ones too
        yield (f"{path}#{i + 1}" if len(docs) > 1 else str(path)), anchored(doc, path.resolve().parent)


_RELATIVE = ("./", "../", "~")


def anchored(doc: Any, base: Path) -> Any:
    """``doc`` with its local paths written ``./…``, ``../…`` or ``~…`` made absolute, from
    ``base`` (the spec file's directory, or the caller's working directory for a dict): the
    manager and the replicas resolve paths in their own working directories (the raylet's), so
    ``model: ./models/tiny`` named a directory the replica did not have. The model, the hub
    cache, a chat template, a generation config's folder and LoRA adapters."""
    if not isinstance(doc, Mapping):
        return doc

    def absolute(value: Any) -> Any:
        if not isinstance(value, str) or not value.startswith(_RELATIVE):
            return value
        return str(Path(value).expanduser() if value.startswith("~") else (base / value).resolve())

    out = dict(doc)
    if "model" in out:
        out["model"] = absolute(out["model"])
    if isinstance(runtime := out.get("runtime_config"), Mapping) and "hf_cache_dir" in runtime:
        out["runtime_config"] = {**runtime, "hf_cache_dir": absolute(runtime["hf_cache_dir"])}
    serving = out.get("serving")
    if isinstance(serving, Mapping) and isinstance(openai := serving.get("openai"), Mapping):
        # generation_config's 'auto' and 'vllm' are not paths, and stay as they are
        paths = {key: absolute(openai[key]) for key in ("chat_template", "generation_config") if key in openai}
        out["serving"] = {**serving, "openai": {**openai, **paths}}
    if isinstance(lora := out.get("lora"), Mapping) and isinstance(adapters := lora.get("adapters"), Mapping):
        out["lora"] = {**lora, "adapters": {name: absolute(source) for name, source in adapters.items()}}
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load``, but a key given twice in one mapping is an error (PyYAML keeps the last
    silently). Keys a merge (``<<: *anchor``) brings in may be overridden, as YAML says: each
    mapping's own keys are checked once, before a merge rewrites its node."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._checked: set[int] = set()  # the mapping nodes whose own keys were checked

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        if id(node) not in self._checked:
            self._checked.add(id(node))
            seen: set[Any] = set()
            for key_node, _value in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node)  # type: ignore[no-untyped-call]
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
        super().flatten_mapping(node)  # type: ignore[no-untyped-call]


def _problem(source: str, err: Any) -> SpecProblem:
    loc = tuple(err["loc"])
    field = _path(loc)
    kind, msg = err["type"], err["msg"]
    if kind == "extra_forbidden":
        key = str(loc[-1])
        allowed = _allowed_keys(loc[:-1])
        close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else f"; allowed keys: {', '.join(allowed)}"
        return SpecProblem(source, field, f"unknown key {key!r}{hint}")
    if kind == "missing":
        return SpecProblem(source, field, "required field is missing")
    if kind == "value_error":
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, FieldValueError):
            field = f"{field}.{cause.field}" if field else cause.field
        return SpecProblem(source, field, msg.removeprefix("Value error, "))
    text = msg[0].lower() + msg[1:]
    return SpecProblem(source, field, f"{text}, got {_show(err.get('input'))}")


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _allowed_keys(loc: tuple[Any, ...]) -> list[str]:
    """Field names of the model found at ``loc`` inside ``Deployment``."""
    model: type[BaseModel] = Deployment
    for part in loc:
        info = model.model_fields.get(str(part))
        nested = _model_of(info.annotation) if info else None
        if nested is None:
            return []
        model = nested
    return list(model.model_fields)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found:
            return found
    return None


def _kind(obj: Any) -> str:
    return {list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean"}.get(
        type(obj), type(obj).__name__
    )


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
