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
from atomr_infer.wire import as_vllm_reads

log = get_logger(__name__)
RETRY_S = 10.0  # after a failed fetch of a deployment's model's tokenizer
FETCH_TIMEOUT_S = 30.0  # a replica that does not answer: try again later (another may)


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):  # {"content": "<s>", ...} as older tokenizer configs have it
        token = token.get("content")
    return token if isinstance(token, str) else None


def _text_content(content: Any) -> Any:
    """OpenAI content parts as the one string templates expect (vLLM's "string" format)."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content


def _as_vllm_renders(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message as vLLM hands it to the template (renderers/chat_utils.py): content as one
    string, an assistant's tool-call arguments parsed into objects (a JSON string was quoted
    again), no empty tool_calls, reasoning under both its names."""
    out = {**message, "content": _text_content(message.get("content"))}
    calls = out.get("tool_calls")
    if out.get("role") == "assistant" and isinstance(calls, list):
        if not calls:
            del out["tool_calls"]
        else:
            out["tool_calls"] = [_parsed_call(c) for c in calls]
    if out.get("role") == "assistant" and out.get("reasoning") is not None:
        out["reasoning_content"] = out["reasoning"]
    return out


def _parsed_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = {}
    return {**call, "function": {**function, "arguments": arguments if isinstance(arguments, dict) else {}}}


def _tool_dicts(tools: Any) -> list[dict[str, Any]] | None:
    """The request's tools as vLLM renders them (``ChatCompletionToolsParam.model_dump()``)."""
    if not isinstance(tools, list):
        return None
    out = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict):
            return None  # vLLM refuses it: nothing to route by
        deferred = tool.get("defer_loading")
        dumped = {"name": function.get("name"), "description": function.get("description"),
                  "parameters": function.get("parameters")}
        for key, value in (("strict", function.get("strict")), ("defer_loading", function.get("defer_loading",
                                                                                               deferred))):
            if value is not None:
                dumped[key] = value
        out.append({"type": tool.get("type", "function"), "function": dumped,
                    **({"defer_loading": deferred} if deferred is not None else {})})
    return out


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """Hugging Face's ``tojson`` (jinja2's own sorts keys and escapes HTML characters)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> Any:
    """A jinja2 environment as Hugging Face's chat templates get it (transformers'
    ``chat_template_utils``): its ``tojson``, ``{% generation %}`` (rendered as its body)."""
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    return env


def _merged(defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``merge_kwargs``: an override of None or "auto" leaves the default."""
    return defaults | {k: v for k, v in overrides.items() if v not in (None, "auto")}


def _template_kwargs(args: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """What vLLM renders a chat's template with, from the request's ``args`` (``RoutingFacts.template``)
    and the server's ``defaults`` (``ChatCompletionRequest.build_chat_params``, then
    ``ChatParams.with_defaults``): its own fields win over its ``chat_template_kwargs``, which win
    over the server's; a ``reasoning_effort`` also sets ``enable_thinking`` unless those do."""
    own = args.get("chat_template_kwargs")
    own = own if isinstance(own, dict) else {}  # (anything else: vLLM answers 400)
    effort = args.get("reasoning_effort")
    fields = {"add_generation_prompt": as_vllm_reads(args.get("add_generation_prompt", True)),
              "continue_final_message": as_vllm_reads(args.get("continue_final_message", False)),
              "documents": args.get("documents"), "reasoning_effort": effort}
    if effort is not None and "enable_thinking" not in own:
        fields["enable_thinking"] = effort != "none"
    return _merged(_merged(defaults, {"tools": _tool_dicts(args.get("tools"))}), _merged(own, fields))


class PromptTokenizer:
    def __init__(self, files: dict[str, str]) -> None:
        from tokenizers import Tokenizer

        # The replica tokenizes with another tokenizer than its model folder's: nothing known here.
        self.untokenizable = files.get("untokenizable")
        self._tokenizer = None if self.untokenizable else Tokenizer.from_str(files["tokenizer.json"])
        config = json.loads(files.get("tokenizer_config.json") or "{}")
        template = files.get("chat_template.jinja") or config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        self._special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "unk_token",
                                                                          "pad_token")}
        defaults = json.loads(files.get("default_chat_template_kwargs.json") or "{}")  # the server's
        self._defaults = defaults if isinstance(defaults, dict) else {}
        env = _environment()

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self._template = env.from_string(template) if isinstance(template, str) else None

    def tokens(self, prompt: Any, template: dict[str, Any] | None = None) -> list[int] | None:
        """The token ids of a completion's ``prompt`` text or a chat's ``messages`` (rendered with
        the request's ``template`` fields: ``RoutingFacts.template``); None when they cannot be
        known here (another tokenizer, no chat template, one that fails on these messages, one
        the request brings)."""
        args = template or {}
        if self._tokenizer is None:
            return None
        if isinstance(prompt, str):  # vLLM adds the model's special tokens (BOS) unless told not to
            return self._tokenizer.encode(prompt, add_special_tokens=as_vllm_reads(args.get("add_special_tokens",
                                                                                              True))).ids
        if not isinstance(prompt, Sequence) or self._template is None or args.get("chat_template"):
            return None  # (a request's own template: vLLM renders with it, "" with the server's)
        kwargs = _template_kwargs(args, self._defaults)
        if kwargs.pop("continue_final_message", False):
            return None  # (continuing the last message cuts the rendered text as transformers does)
        messages = [_as_vllm_renders(m) for m in prompt if isinstance(m, dict)]
        try:  # as transformers' apply_chat_template renders: these by name, the rest after the special tokens
            text = self._template.render(
                messages=messages, tools=kwargs.pop("tools", None), documents=kwargs.pop("documents", None),
                add_generation_prompt=kwargs.pop("add_generation_prompt", False), **{**self._special, **kwargs},
            )
        except Exception:  # noqa: BLE001 - a template's own refusal: route without it
            return None
        # A rendered chat holds its special tokens: vLLM adds more only when asked (add_special_tokens).
        return self._tokenizer.encode(text, add_special_tokens=as_vllm_reads(args.get("add_special_tokens"))).ids


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
            if tokenizer.untokenizable:  # kept: not asked for again; its requests go by prefix affinity
                log.info("prompt_tokenizer_unknown", deployment=deployment, model=model, why=tokenizer.untokenizable)
            else:
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
