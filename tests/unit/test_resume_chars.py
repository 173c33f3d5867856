"""A stream that moves between the tokens of one character (an emoji is several tokens of SmolLM2's
byte-level vocabulary): the ids told to the router stop at the last whole character, so the
continuation, detokenized by vLLM after the prompt and those ids, joins the text exactly
(engine/vllm/resume.py). Told every id, a continuation that starts inside a character gets the
prompt's text back from vLLM's incremental detokenizer."""

from __future__ import annotations

import types

import pytest
from transformers import AutoTokenizer
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.detokenizer import IncrementalDetokenizer

from atomr_infer.engine.vllm.resume import CharBoundary, extend_request


@pytest.fixture(scope="module")
def tokenizer(bundled_model_dir):
    return AutoTokenizer.from_pretrained(bundled_model_dir)


def detokenized(tokenizer, prompt_ids: list[int], generated: list[int]) -> str:
    """The text vLLM's serving layer sends for ``generated``, one token a step, after ``prompt_ids``."""
    params = SamplingParams(max_tokens=100, output_kind=RequestOutputKind.DELTA)
    request = types.SimpleNamespace(request_id="r", prompt_token_ids=list(prompt_ids), sampling_params=params,
                                    prompt_embeds=None)
    detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
    text = ""
    for token_id in generated:
        detokenizer.update([token_id], False)
        text += detokenizer.get_next_output_text(False, True)
    return text


def told_after_each_step(chars: CharBoundary | None, generated: list[int]) -> list[list[int]]:
    """The ids the router has after each step (one token a step), as the engine client tells them."""
    told, unsaid, seen = [], [], []
    for token_id in generated:
        new, unsaid = chars.split(unsaid, [token_id]) if chars else ([token_id], [])
        told.extend(new)
        seen.append(list(told))
    return seen


def test_a_stream_moved_at_any_step_joins_its_text_exactly(tokenizer):
    prompt = tokenizer.encode("Say hi:")
    generated = tokenizer.encode(" hi 😀 and 龘 then 🐉🐉 ok")
    whole = detokenized(tokenizer, prompt, generated)
    assert "😀" in whole and "🐉🐉" in whole

    def moved_texts(chars):
        texts = []
        for told in told_after_each_step(chars, generated):
            # What the client had (vLLM's text up to the router's ids), then the continuation.
            params = SamplingParams(max_tokens=50)
            request = types.SimpleNamespace(prompt_token_ids=list(prompt), sampling_params=params)
            extend_request(request, told)
            texts.append(detokenized(tokenizer, prompt, told) + detokenized(
                tokenizer, request.prompt_token_ids, generated[len(told):]))
        return texts

    assert moved_texts(CharBoundary(tokenizer)) == [whole] * len(generated)
    assert moved_texts(None) != [whole] * len(generated)  # told every id: some moves repeat the prompt


def test_ids_ending_inside_a_character_are_held_until_it_is_whole(tokenizer):
    chars = CharBoundary(tokenizer)
    emoji = tokenizer.encode("😀")
    assert len(emoji) >= 2  # several tokens: what makes the case
    word = tokenizer.encode(" ok")
    assert chars.held(word) == 0
    assert chars.held([*word, *emoji[:-1]]) == len(emoji) - 1
    assert chars.held([*word, *emoji]) == 0
    assert chars.held([]) == 0
