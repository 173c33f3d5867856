"""``serving:`` of a deployment: admission limits, vLLM's OpenAI server options, rate limits
and stream migration."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from atomr_infer.spec.base import FieldValueError, Number, Strict


class ResponseStore(Strict):
    """vLLM's store of Responses-API responses (``VLLM_ENABLE_RESPONSES_API_STORE``), bounded.

    Each replica keeps the responses it made, in memory: ``store``, ``previous_response_id``,
    ``background`` and ``GET /v1/responses/{id}`` work as on ``vllm serve`` with the store on.
    A stored response lives until it is ``max_age_s`` old or ``max_responses`` newer ones
    pushed it out, and never longer than its replica."""

    enabled: StrictBool = Field(False, description="Keep responses (`store: true`) for later requests; off as in vLLM.")
    max_responses: Annotated[StrictInt, Field(ge=1, le=10_000_000)] = Field(
        10_000, description="Responses one replica keeps at most; the oldest go first."
    )
    max_age_s: Annotated[Number, Field(gt=0, le=30 * 86400)] = Field(
        3600.0, description="Seconds a stored response is kept after it was last written."
    )


# vLLM's server options the spec sets through fields of its own.
_SERVER_ARGS_OWNED = {
    "served_model_name": "serving.openai.served_model_name", "chat_template": "serving.openai.chat_template",
    "tool_call_parser": "serving.openai.tool_call_parser", "reasoning_parser": "serving.openai.reasoning_parser",
    "enable_auto_tool_choice": "serving.openai.enable_auto_tool_choice", "lora_modules": "lora.adapters",
    "model": "model",
}
# `vllm serve`'s options of its HTTP server and process (FrontendArgs beyond BaseFrontendArgs):
# `atomr serve`'s to set, for every deployment at once.
_SERVER_ARGS_HTTP = frozenset({
    "host", "port", "uds", "uvicorn_log_level", "disable_uvicorn_access_log", "disable_access_log_for_endpoints",
    "allow_credentials", "allowed_origins", "allowed_methods", "allowed_headers", "api_key", "ssl_keyfile",
    "ssl_certfile", "ssl_ca_certs", "enable_ssl_refresh", "ssl_cert_reqs", "ssl_ciphers", "root_path", "middleware",
    "enable_request_id_headers", "disable_fastapi_docs", "enable_offline_docs", "grpc_port", "headless",
    "api_server_count", "data_parallel_supervisor_port",
})
# Of those, the ones `atomr serve` (and `atomr up --serve`) has a flag for: the refusal names it.
_SERVER_ARGS_FLAGS = {name: f"--{name.replace('_', '-')}` sets it" for name in (
    "host", "port", "allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials",
    "enable_request_id_headers")} | {"api_key": "--api-keys FILE` (a YAML file of keys) sets the API's keys"}


class OpenAIServing(Strict):
    """Options of vLLM's OpenAI server (``vllm serve``'s flags, in snake case). The replica runs
    that server, so changing them restarts the replicas (rolling)."""

    served_model_name: list[StrictStr] = Field(
        default_factory=list,
        description="More names the deployment answers to as the OpenAI `model` (its name always works).",
    )
    chat_template: StrictStr | None = Field(
        None, description="A chat template (Jinja text or a file path) instead of the tokenizer's."
    )
    tool_call_parser: StrictStr | None = Field(
        None, description="Parses tool calls out of the model's text, e.g. 'hermes', 'llama3_json', 'gemma4'."
    )
    enable_auto_tool_choice: StrictBool = Field(
        False, description="Let the model decide to call tools (tool_choice: auto); needs tool_call_parser."
    )
    reasoning_parser: StrictStr | None = Field(
        None, description="Splits reasoning from the answer (`reasoning_content`), e.g. 'deepseek_r1', 'gemma4'."
    )
    generation_config: StrictStr | None = Field(
        None, description="Default sampling: 'auto' (the model's generation_config.json), 'vllm', or a folder."
    )
    override_generation_config: dict[StrictStr, Any] | None = Field(
        None, description="Default sampling values over the generation config, e.g. {temperature: 0.6}."
    )

    server_args: dict[StrictStr, Any] = Field(
        default_factory=dict,
        description="More of `vllm serve`'s options for the model's server, snake case, e.g. "
        "{default_chat_template_kwargs: {enable_thinking: false}, enable_prompt_tokens_details: true}.",
    )

    response_store: ResponseStore = Field(
        default_factory=ResponseStore, description="Stored Responses-API responses, kept per replica."
    )

    @field_validator("server_args")
    @classmethod
    def _server_args(cls, args: dict[str, Any]) -> dict[str, Any]:
        for key, value in args.items():
            if key in _SERVER_ARGS_OWNED:
                raise ValueError(f"{key}: set {_SERVER_ARGS_OWNED[key]} instead")
            if key in _SERVER_ARGS_FLAGS:
                raise ValueError(f"{key}: `atomr serve` runs the HTTP server: `atomr serve {_SERVER_ARGS_FLAGS[key]}, "
                                 "for every deployment")
            if key in _SERVER_ARGS_HTTP:
                raise ValueError(f"{key}: `atomr serve` runs the HTTP server (its flags and docs/cli.md say what it "
                                 "takes); server_args are the options of the model's server")
            if value is None:
                raise ValueError(f"{key}: is null; leave it out for vLLM's default")
        return args

    @field_validator("served_model_name")
    @classmethod
    def _aliases(cls, names: list[str]) -> list[str]:
        for i, name in enumerate(names):
            if not name.strip():
                raise ValueError(f"[{i}] is {name!r}: a name a request can give as its model, not empty")
            if name in names[:i]:
                raise ValueError(f"[{i}] {name!r} is given twice")
        return names

    @model_validator(mode="after")
    def _auto_needs_parser(self) -> OpenAIServing:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise FieldValueError("tool_call_parser", "is required when enable_auto_tool_choice is true")
        return self


class RateLimits(Strict):
    """The deployment's budget over the HTTP API, whatever the key (``atomr serve``)."""

    requests_per_minute: Annotated[StrictInt, Field(ge=1, le=100_000_000)] | None = Field(
        None, description="Requests per minute to this deployment; over it, HTTP 429 with Retry-After."
    )
    tokens_per_minute: Annotated[StrictInt, Field(ge=1, le=100_000_000_000)] | None = Field(
        None, description="Prompt plus completion tokens per minute; spent, HTTP 429 until it refills."
    )


class Migration(Strict):
    """Requests resumed on another replica when theirs dies mid-stream (changed in place)."""

    enabled: StrictBool = Field(
        True, description="Resume a stream whose replica died on another, after what it had generated."
    )
    max_tries: Annotated[StrictInt, Field(ge=1, le=16)] = Field(
        2, description="Most times one request moves before it fails with the replica's error."
    )


class Serving(Strict):
    """Per-replica admission limits (changed in place) and vLLM's OpenAI server options."""

    max_concurrent: Annotated[StrictInt, Field(ge=1, le=65_536)] = Field(
        32, description="Requests one replica runs at once; more wait or are rejected."
    )
    on_capacity_exhausted: Literal["queue", "reject"] = Field(
        "queue", description="'queue' waits for a free slot; 'reject' fails at once (HTTP 429)."
    )
    openai: OpenAIServing = Field(default_factory=OpenAIServing, description="vLLM's OpenAI server options.")
    rate_limits: RateLimits = Field(default_factory=RateLimits, description="Over the HTTP API; changed in place.")
    migration: Migration = Field(
        default_factory=Migration, description="Streams resumed on another replica when theirs dies; in place."
    )
