"""Model references → local directories. No network: the hub is offline or stands in as a fake."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from atomr_infer.errors import ModelError
from atomr_infer.models import cache_root, hub_cache_dir, is_cached, resolve_model

from .hub_cache import fake_snapshot

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
# --- local paths ---------------------------------------------------------------------------


def test_local_directory_without_config_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ModelError) as err:
        resolve_model(str(tmp_path))
    assert str(tmp_path) in str(err.value)
    assert "config.json" in str(err.value)
    assert err.value.hint


def test_nonexistent_local_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ModelError, match="does not exist") as err:
        resolve_model(str(missing))
    assert str(missing) in str(err.value)


def test_local_file_is_not_a_model_directory(tmp_path: Path) -> None:
    (tmp_path / "weights.gguf").write_text("")
    with pytest.raises(ModelError, match="not a directory"):
        resolve_model(str(tmp_path / "weights.gguf"))


def test_local_directory_with_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    monkeypatch.setenv("HOME", str(tmp_path))
    resolved = resolve_model("~/m")
    assert resolved.path == (tmp_path / "m").resolve()
    assert resolved.source == "local"
    assert resolved.ref == "~/m"
    assert is_cached("~/m")


def test_relative_local_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path / "m")
    assert resolve_model("./").path == (tmp_path / "m").resolve()
    assert resolve_model("../m").path == (tmp_path / "m").resolve()


# --- bundled -------------------------------------------------------------------------------


def test_unknown_bundled_model_lists_the_known_ones() -> None:
    with pytest.raises(ModelError, match="unknown bundled model") as err:
        resolve_model("bundled:gpt-17")
    assert "bundled:smollm2-135m-instruct" in err.value.hint
    assert not is_cached("bundled:gpt-17")


def test_cache_root_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ATOMR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "atomr-infer"
    monkeypatch.setenv("ATOMR_CACHE_DIR", str(tmp_path / "atomr"))
    assert cache_root() == tmp_path / "atomr"


# --- Hugging Face hub ----------------------------------------------------------------------


def test_offline_and_not_cached(offline_hub: Path) -> None:
    assert not is_cached(REPO)
    with pytest.raises(ModelError) as err:
        resolve_model(REPO)
    text = str(err.value)
    assert "not in the HF cache" in text
    assert str(offline_hub) in text
    assert "HF_HUB_OFFLINE is set" in text
    assert "hf download" in err.value.hint


def test_offline_with_an_explicit_cache_dir(offline_hub: Path, tmp_path: Path) -> None:
    other = tmp_path / "spec-cache"
    other.mkdir()
    with pytest.raises(ModelError, match="not in the HF cache") as err:
        resolve_model(REPO, cache_dir=str(other))
    assert str(other) in str(err.value)


def test_offline_from_the_cache(offline_hub: Path) -> None:
    snapshot = fake_snapshot(offline_hub, REPO, {"config.json": "{}", "model.safetensors": "x"})
    assert is_cached(REPO)
    messages: list[str] = []
    resolved = resolve_model(REPO, progress=messages.append)
    assert resolved.source == "hub"
    assert resolved.path == snapshot
    assert messages


def test_incomplete_sharded_snapshot_is_not_cached(offline_hub: Path) -> None:
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    fake_snapshot(
        offline_hub,
        REPO,
        {
            "config.json": "{}",
            "model.safetensors.index.json": json.dumps(index),
            "model-00001-of-00002.safetensors": "x",
        },
    )
    assert not is_cached(REPO)
    with pytest.raises(ModelError, match="no complete set of"):
        resolve_model(REPO)


def test_hub_cache_dir_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache_dir() == tmp_path / "hf" / "hub"
    assert hub_cache_dir(str(tmp_path / "spec")) == tmp_path / "spec"


def test_invalid_repo_id(offline_hub: Path) -> None:
    with pytest.raises(ModelError, match="not a valid Hugging Face repo id"):
        resolve_model("not//a valid id")


def _http_error(cls: type[Exception], status: int) -> Exception:
    httpx = pytest.importorskip("httpx")
    response = httpx.Response(status, request=httpx.Request("GET", f"https://huggingface.co/api/models/{REPO}"))
    return cls("refused", response=response)


@pytest.mark.parametrize(
    ("error", "status", "message"),
    [
        ("GatedRepoError", 401, "gated"),
        ("RepositoryNotFoundError", 404, "no such repository"),
        ("HfHubHTTPError", 403, "refused access"),
    ],
)
def test_hub_errors_become_model_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: str, status: int, message: str
) -> None:
    """The hub is out of reach in tests; a fake snapshot_download raises what the real one does."""
    import huggingface_hub
    from huggingface_hub import errors

    raised = _http_error(getattr(errors, error), status)

    def fake_snapshot_download(*args: object, **kwargs: object) -> str:
        raise raised

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    with pytest.raises(ModelError, match=message) as err:
        resolve_model("org/private-model", cache_dir=str(tmp_path))
    if status in (401, 403):
        assert "HF_TOKEN" in err.value.hint
    restored = pickle.loads(pickle.dumps(err.value))  # crosses Ray actor boundaries
    assert str(restored) == str(err.value)


def test_hub_download_asks_only_for_what_vllm_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    calls: list[dict[str, object]] = []

    def fake_snapshot_download(repo_id: str, **kwargs: object) -> str:
        calls.append({"repo_id": repo_id, **kwargs})
        return str(fake_snapshot(tmp_path, repo_id, {"config.json": "{}", "model.safetensors": "x"}))

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    resolve_model(REPO, cache_dir=str(tmp_path))
    (call,) = calls
    assert call["cache_dir"] == str(tmp_path)
    assert call["token"] == "hf_test"
    assert call["local_files_only"] is False
    assert "*.safetensors" in call["allow_patterns"] and "*.json" in call["allow_patterns"]
    assert {"*.bin", "*.pth", "*.gguf"} <= set(call["ignore_patterns"])


# --- the spec's revision, token and remote code -------------------------------------------------

TAGGED = "fedcba9876543210fedcba9876543210fedcba98"


def _deployment(**engine_args: object) -> object:
    from atomr_infer.spec import parse_deployment

    return parse_deployment({"name": "m", "model": REPO, "runtime_config": {"extra_engine_args": engine_args}})


def test_a_revision_resolves_to_its_own_snapshot(offline_hub: Path) -> None:
    """vLLM is given the snapshot's directory, where it ignores ``revision``: the replica must
    resolve the revision itself, or it serves main's weights under the spec's revision."""
    from atomr_infer.models.estimate import local_model_config
    from atomr_infer.models.resolve import HubOptions, resolve_for

    main = fake_snapshot(offline_hub, REPO, {"config.json": '{"at": "main"}', "model.safetensors": "x"})
    tagged = fake_snapshot(offline_hub, REPO, {"config.json": '{"at": "v2"}', "model.safetensors": "x"},
                           ref="v2", commit=TAGGED)
    assert resolve_model(REPO).path == main
    assert resolve_model(REPO, hub=HubOptions(revision="v2")).path == tagged
    assert resolve_model(REPO, hub=HubOptions(revision=TAGGED)).path == tagged
    assert resolve_for(_deployment(revision="v2")).path == tagged
    assert resolve_for(_deployment()).path == main
    # What the manager reads at apply (memory estimate, context length) is that snapshot's too.
    assert local_model_config(REPO, None, "v2") == {"at": "v2"}
    assert local_model_config(REPO) == {"at": "main"}


def test_a_revision_not_in_the_offline_cache_is_named(offline_hub: Path) -> None:
    from atomr_infer.models.resolve import HubOptions

    fake_snapshot(offline_hub, REPO, {"config.json": "{}", "model.safetensors": "x"})
    with pytest.raises(ModelError, match="at revision v9 are not in the HF cache") as err:
        resolve_model(REPO, hub=HubOptions(revision="v9"))
    assert "--revision v9" in err.value.hint


def test_the_spec_chooses_revision_token_and_remote_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    from atomr_infer.models.resolve import resolve_for

    calls: list[dict[str, object]] = []

    def fake_snapshot_download(repo_id: str, **kwargs: object) -> str:
        calls.append(kwargs)
        return str(fake_snapshot(tmp_path / str(len(calls)), repo_id, {"config.json": "{}", "model.safetensors": "x"}))

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    resolve_for(_deployment(revision="v2", hf_token="hf_spec", trust_remote_code=True))
    resolve_for(_deployment(hf_token=False, trust_remote_code="false"))
    resolve_for(_deployment())
    spec, no_token, plain = calls
    assert (spec["revision"], spec["token"]) == ("v2", "hf_spec")
    assert "*.py" in spec["allow_patterns"]  # the modeling code vLLM imports under trust_remote_code
    assert (no_token["revision"], no_token["token"]) == (None, False)
    assert "*.py" not in no_token["allow_patterns"]
    assert (plain["revision"], plain["token"]) == (None, "hf_env")
