"""A prompt's token ids as the engine will see them, computed by a router (``routing.policy:
kv_events`` matches them against what each replica's KV-cache events say it holds).

With the ``tokenizers`` library and the model's own chat template rendered by jinja2 as
Hugging Face renders it: no torch, no transformers, no vLLM (issue 20: only replicas load
them). The files come from a replica (``VllmReplica.tokenizer_files``), once per deployment and
model (a roll may change it) per process. Measured against a round trip to the replica to
tokenize there: see docs/performance.md (``scripts/bench_kv_index.py``). A template this cannot render, or content
it renders differently from vLLM, costs only cache hits: the router then finds no blocks held.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import time
from collections.abc import Sequence
from typing import Any

from atomr_infer.log import get_logger
from atomr_infer.task_context import outside_request

log = get_logger(__name__)
RETRY_S = 10.0  # after a failed fetch of a deployment's model's tokenizer
FETCH_TIMEOUT_S = 30.0  # a replica that does not answer: try again later (another may)


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):  # {"content": "<s>", ...} as older tokenizer configs have it
        token = token.get("content")
    return token if isinstance(token, str) else None


def _text_content(content: Any) -> Any:
    """OpenAI content parts as the one string templates expect (vLLM's "string" format)."""
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content


class PromptTokenizer:
    def __init__(self, files: dict[str, str]) -> None:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_str(files["tokenizer.json"])
        config = json.loads(files.get("tokenizer_config.json") or "{}")
        template = files.get("chat_template.jinja") or config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        self._special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "unk_token",
                                                                          "pad_token")}
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self._template = env.from_string(template) if isinstance(template, str) else None

    def tokens(self, prompt: Any) -> list[int] | None:
        """The token ids of a completion's ``prompt`` text or a chat's ``messages``; None when
        they cannot be known here (no chat template, one that fails on these messages)."""
        if isinstance(prompt, str):
            return self._tokenizer.encode(prompt).ids
        if not isinstance(prompt, Sequence) or self._template is None:
            return None
        messages = [{**m, "content": _text_content(m.get("content"))} for m in prompt if isinstance(m, dict)]
        try:
            text = self._template.render(messages=messages, add_generation_prompt=True, tools=None,
                                         **self._special)
        except Exception:  # noqa: BLE001 - a template's own refusal: route without it
            return None
        return self._tokenizer.encode(text, add_special_tokens=False).ids  # as vLLM encodes a rendered chat


class TokenizerCache:
    """Each deployment's ``PromptTokenizer`` in this process, per model its replicas serve (a
    roll may change the model), fetched from a replica serving it in the background the first
    time it is asked for (None until then); ``retain`` forgets the models no replica serves."""

    def __init__(self) -> None:
        self._ready: dict[tuple[str, str], PromptTokenizer] = {}
        self._fetching: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._failed_at: dict[tuple[str, str], float] = {}
        self._served: dict[str, set[str]] = {}  # deployment -> the models its replicas serve (retain)

    def get(self, deployment: str, replica_actor: Any, model: str) -> PromptTokenizer | None:
        key = (deployment, model)
        found = self._ready.get(key)
        if found is not None or key in self._fetching:
            return found
        if time.monotonic() - self._failed_at.get(key, -RETRY_S) < RETRY_S:
            return None
        # Outside the request that asked: its caller leaving must not cancel the fetch.
        self._fetching[key] = outside_request(asyncio.get_running_loop().create_task, self._fetch(key, replica_actor))
        return None

    def retain(self, models: dict[str, set[str]]) -> None:
        """For each deployment named, keep only the tokenizers of ``models[deployment]`` (the
        models its replicas serve), including those still being fetched; others are left alone
        (routers of this process may follow other tables)."""
        self._served.update(models)
        for held in (self._ready, self._failed_at):
            for key in list(held):  # a copy: a Client's thread may add meanwhile
                if key[0] in models and key[1] not in models[key[0]]:
                    held.pop(key, None)

    async def _fetch(self, key: tuple[str, str], actor: Any) -> None:
        deployment, model = key
        try:
            files = await asyncio.wait_for(asyncio.wrap_future(actor.tokenizer_files.remote().future()),
                                           FETCH_TIMEOUT_S)
            tokenizer = await asyncio.to_thread(PromptTokenizer, files)
            if model not in self._served.get(deployment, {model}):  # no replica serves it (any more)
                self._failed_at[key] = time.monotonic()  # not asked for again at once
                return
            self._ready[key] = tokenizer
            log.info("prompt_tokenizer_ready", deployment=deployment, model=model)
        except Exception as exc:  # noqa: BLE001 - routing goes on without it (prefix_affinity)
            self._failed_at[key] = time.monotonic()
            log.warning("prompt_tokenizer_failed", deployment=deployment, model=model,
                        error=f"{type(exc).__name__}: {exc}")
        finally:
            del self._fetching[key]


_CACHE: TokenizerCache | None = None


def tokenizers() -> TokenizerCache:
    """This process's tokenizers (every router in it shares them)."""
    global _CACHE
    if _CACHE is None:
        _CACHE = TokenizerCache()
    return _CACHE
