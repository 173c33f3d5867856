"""vLLM's ``EngineClient`` over a replica's step loop, so vLLM's own OpenAI serving classes run
in the replica while one thread still owns and steps the engine.

vLLM's serving layer (chat, completions, embeddings, tokenize; ``vllm serve`` uses the same
classes over ``AsyncLLM``) reads ``model_config``, ``vllm_config``, ``renderer`` and
``input_processor`` at start, and per request calls ``generate`` / ``encode``, reads
``errored`` / ``dead_error`` and ``check_admission`` (vLLM's queue limits). That is all it needs of an engine
(counted in vLLM 0.32); the rest of the protocol answers "not supported".

Each request is processed into an ``EngineCoreRequest`` here, on the actor's event loop, as
``AsyncLLM.add_request`` does (the input processor only reads configs and the tokenizer);
the step-loop thread adds it to the engine, so the output processor and the engine core are
touched by that thread alone. Outputs come back through the replica's per-request streams.
Cancellation (a client that left) aborts the request in the engine within one step.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from typing import Any, Protocol

from vllm.engine.protocol import EngineClient
from vllm.renderers.inputs.preprocess import extract_prompt_components
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import EngineCoreRequest

from atomr_infer.engine.backend import engine_call_timeout_s
from atomr_infer.engine.vllm.inline_tokenize import tokenize_short_prompts_inline
from atomr_infer.engine.vllm.prefill_watch import PREFILLED
from atomr_infer.engine.vllm.resume import RESUME, TOKENS, CharBoundary, as_whole, extend_request
from atomr_infer.engine.vllm.stream import RequestStream
from atomr_infer.errors import EngineError


class RequestGate(Protocol):
    """The replica's side: open a stream and submit to the step loop; abort; health."""

    def submit(self, request: EngineCoreRequest, prompt_text: str | None, prompt_tokens: int) -> RequestStream: ...

    def watch_prefill(self, stream: RequestStream, request: EngineCoreRequest, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the engine has computed the prompt of ``request`` (submitted); a
        request of several prompts watches each, so the callback must bear being called again."""

    def finish(self, stream: RequestStream) -> None:
        """The consumer is done with ``stream`` (finished, failed or gone: abort if still running)."""

    def dead_error(self) -> BaseException | None: ...

    def queue(self) -> tuple[int, int]:
        """(sequences unfinished in the engine, prompt tokens of the requests with no output yet)."""

    async def engine_call(self, fn: Callable[[Any], Any], timeout_s: float = ...) -> Any:
        """``fn(engine)`` run by the step loop between two steps; ``TimeoutError`` past ``timeout_s``."""


class StepLoopEngineClient(EngineClient):
    def __init__(self, engine: Any, gate: RequestGate) -> None:
        self.vllm_config = engine.vllm_config
        self.model_config = engine.model_config
        self.renderer = engine.renderer
        tokenize_short_prompts_inline(self.renderer)
        self.input_processor = engine.input_processor
        self._supported_tasks = tuple(engine.get_supported_tasks())
        self._gate = gate
        tokenizer = getattr(self.renderer, "tokenizer", None)
        self._chars = CharBoundary(tokenizer) if tokenizer is not None else None  # for resumable streams

    # -- state -------------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._gate.dead_error() is None

    @property
    def is_stopped(self) -> bool:
        return not self.is_running

    @property
    def errored(self) -> bool:
        return self._gate.dead_error() is not None

    @property
    def dead_error(self) -> BaseException:
        from vllm.v1.engine.exceptions import EngineDeadError

        return self._gate.dead_error() or EngineDeadError()

    async def get_supported_tasks(self) -> tuple[Any, ...]:
        return self._supported_tasks

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        """vLLM's queue limits, as ``AsyncLLM`` checks them (vLLM's serving layer answers 503):
        ``max_num_queued_reqs`` over the sequences unfinished (``n`` > 1 counts ``n``), and
        ``max_num_queued_tokens`` over the prompts not prefilled yet. Inherited, they were no-ops."""
        from vllm.exceptions import MaxQueuedTokensError, QueueOverflowError

        scheduler = self.vllm_config.scheduler_config
        max_requests = getattr(scheduler, "max_num_queued_reqs", None)
        max_tokens = getattr(scheduler, "max_num_queued_tokens", None)
        if max_requests is None and max_tokens is None:
            return
        sequences, prompt_tokens = self._gate.queue()
        if max_requests is not None and sequences + n > max_requests:
            raise QueueOverflowError()
        if max_tokens is not None and prompt_tokens >= max_tokens:
            raise MaxQueuedTokensError()

    # -- requests ----------------------------------------------------------------------------

    async def _process(self, request_id: str, prompt: Any, params: Any, **kw: Any) -> tuple[EngineCoreRequest, Any]:
        """``EngineCoreRequest`` and prompt text, as ``AsyncLLM.add_request`` makes them."""
        if self.errored:
            raise self.dead_error
        if self.vllm_config.cache_config.kv_sharing_fast_prefill and getattr(params, "prompt_logprobs", None):
            from vllm.exceptions import VLLMValidationError  # refused as AsyncLLM.add_request refuses it

            raise VLLMValidationError("--kv-sharing-fast-prefill produces incorrect logprobs for prompt tokens, "
                                      "please disable it when the requests need prompt logprobs")
        if isinstance(prompt, EngineCoreRequest):
            return prompt, kw.get("prompt_text")
        options = dict(
            supported_tasks=self._supported_tasks,
            lora_request=kw.get("lora_request"),
            tokenization_kwargs=kw.get("tokenization_kwargs"),
            trace_headers=kw.get("trace_headers"),
            priority=kw.get("priority", 0),
            session_id=kw.get("session_id"),
            kv_hints=kw.get("kv_hints"),
        )
        if isinstance(prompt, dict) and "type" in prompt:  # rendered: nothing blocking left
            request = self.input_processor.process_inputs(request_id, prompt, params, **options)
        else:
            request = await self.input_processor.process_inputs_async(request_id, prompt, params, **options)
        prompt_text, _, _ = extract_prompt_components(self.model_config, prompt)
        return request, prompt_text

    async def _stream(self, request: EngineCoreRequest, prompt_text: str | None) -> AsyncGenerator[Any, None]:
        resume = RESUME.get() if request.sampling_params is not None else None
        if resume is not None:  # a stream another replica began (resume.py)
            extend_request(request, resume)
        prompt_tokens = len(request.prompt_token_ids or ())
        stream = self._gate.submit(request, prompt_text, prompt_tokens)
        params = request.sampling_params
        sink = TOKENS.get() if params is not None else None
        prefilled = PREFILLED.get()
        if prefilled is not None and params is not None and params.output_kind == RequestOutputKind.FINAL_ONLY:
            self._gate.watch_prefill(stream, request, prefilled)  # no output says so before the last
        try:
            if resume is None and sink is None:
                async for output in stream:
                    yield output
            else:
                first, unsaid = True, []  # unsaid: ids ending inside a character, not told yet
                async for output in stream:
                    new = list(output.outputs[0].token_ids) if sink is not None and output.outputs else None
                    yield as_whole(output, resume, first) if resume else output
                    first = False
                    if new:  # the serving layer put this output's bytes and asks for the next
                        told, unsaid = self._chars.split(unsaid, new) if self._chars else (new, [])
                        if told:
                            sink(told)
        finally:  # also on cancellation and GeneratorExit: abort in the engine if still running
            self._gate.finish(stream)

    async def generate(
        self,
        prompt: Any,
        sampling_params: Any,
        request_id: str,
        *,
        prompt_text: str | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        session_id: str | None = None,
        kv_hints: Any = None,
        reasoning_ended: bool | None = None,
        reasoning_parser_kwargs: dict[str, Any] | None = None,
    ) -> AsyncGenerator[Any, None]:
        request, text = await self._process(
            request_id, prompt, sampling_params, prompt_text=prompt_text, lora_request=lora_request,
            tokenization_kwargs=tokenization_kwargs, trace_headers=trace_headers, priority=priority,
            session_id=session_id, kv_hints=kv_hints,
        )
        if reasoning_ended is not None:
            request.reasoning_ended = reasoning_ended
        if reasoning_parser_kwargs is not None:
            request.reasoning_parser_kwargs = reasoning_parser_kwargs
        async for output in self._stream(request, text):
            yield output

    async def encode(
        self,
        prompt: Any,
        pooling_params: Any,
        request_id: str,
        lora_request: Any = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        tokenization_kwargs: dict[str, Any] | None = None,
        reasoning_ended: bool | None = None,
    ) -> AsyncGenerator[Any, None]:
        request, text = await self._process(
            request_id, prompt, pooling_params, lora_request=lora_request, trace_headers=trace_headers,
            priority=priority, tokenization_kwargs=tokenization_kwargs,
        )
        async for output in self._stream(request, text):
            yield output

    async def abort(self, request_id: str | Iterable[str]) -> None:
        pass  # the stream's consumer aborts when it leaves (_stream's finally)

    # -- the rest of the protocol: not what a replica's serving layer needs ------------------

    async def check_health(self) -> None:
        if self.errored:
            raise self.dead_error

    async def is_tracing_enabled(self) -> bool:
        return False

    async def do_log_stats(self) -> None:
        return None

    async def notify_kv_transfer_request_rejected(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def start_profile(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("profiling is not available through an atomr replica")

    async def stop_profile(self) -> None:
        raise NotImplementedError("profiling is not available through an atomr replica")

    async def reset_mm_cache(self) -> None:
        return None

    async def reset_encoder_cache(self) -> None:
        return None

    async def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        return False

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("sleep mode is not available through an atomr replica")

    async def release_kv_cache_memory(self) -> None:
        raise NotImplementedError("sleep mode is not available through an atomr replica")

    async def wake_up(self, *args: Any, **kwargs: Any) -> bool:
        return False

    async def is_sleeping(self) -> bool:
        return False

    async def add_lora(self, lora_request: Any) -> bool:
        timeout_s = engine_call_timeout_s()
        try:
            return bool(await self._gate.engine_call(lambda engine: engine.add_lora(lora_request), timeout_s))
        except TimeoutError:
            # vLLM's load_lora_adapter reports str(error): a bare TimeoutError's is empty.
            raise EngineError(f"the engine took over {timeout_s:g}s to load it "
                              "(ATOMR_ENGINE_CALL_TIMEOUT_S)") from None

    async def pause_generation(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("pausing is not available through an atomr replica")

    async def resume_generation(self) -> None:
        return None

    async def is_paused(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        return None
