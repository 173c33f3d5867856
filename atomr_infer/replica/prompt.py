"""Turn a ``GenerateRequest`` into prompt token ids and vLLM ``SamplingParams``.

Tokenizing here, before the engine sees the request, lets a replica reject an over-long
prompt with an error naming the field, and gives exact prompt token counts for usage.
"""

from __future__ import annotations

from typing import Any

from atomr_infer.errors import InvalidRequest
from atomr_infer.replica.request import GenerateRequest


class PromptBuilder:
    def __init__(self, tokenizer: Any, log: Any) -> None:
        self._tokenizer = tokenizer
        self._log = log
        self._has_template = bool(getattr(tokenizer, "chat_template", None))
        self._warned = False

    def token_ids(self, req: GenerateRequest) -> list[int]:
        if req.prompt is not None:
            ids = list(self._tokenizer.encode(req.prompt))
        else:
            ids = list(self._tokenizer.encode(self.render_chat(req), add_special_tokens=False))
        if not ids:
            raise InvalidRequest(req.input_field, "the prompt is empty")
        return ids

    def render_chat(self, req: GenerateRequest) -> str:
        messages = [m.model_dump() for m in req.messages or ()]
        if self._has_template:
            return str(self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        if not self._warned:  # once per replica: every chat request takes this path
            self._log.warning("no_chat_template", fallback="role-tagged plain text")
            self._warned = True
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "

    def sampling_params(self, req: GenerateRequest, prompt_len: int, max_model_len: int | None) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        max_tokens = req.max_tokens
        if max_model_len is not None:
            room = max_model_len - prompt_len
            if room < 1:
                raise InvalidRequest(
                    req.input_field,
                    f"the prompt is {prompt_len} tokens; this model's context (max_model_len) is "
                    f"{max_model_len} tokens, leaving no room to generate",
                )
            if max_tokens is None:
                max_tokens = room
            elif max_tokens > room:
                raise InvalidRequest(
                    "max_tokens",
                    f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens exceeds the context "
                    f"(max_model_len={max_model_len}); at most {room} for this prompt",
                )
        return SamplingParams(
            n=1,
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stop=req.stop,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
        )
