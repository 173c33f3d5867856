"""routing.policy kv_events: the router's token ids of a request are the ones vLLM's server gives
it (its request models' merging, its chat rendering, its tokenizer), field by field: one that
differs at the first block costs the client every cache hit."""

from __future__ import annotations

import copy
import json
import shutil
from types import SimpleNamespace

import pytest

# A template that shows each field vLLM renders a chat with (the special tokens, documents, tools,
# reasoning_effort, the enable_thinking vLLM derives from it, a template argument of its own).
FIELDS_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if documents %}<docs>{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}</docs>{% endif %}"
    "{%- if tools %}<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}</tools>{% endif %}"
    "{%- if reasoning_effort is defined %}<effort>{{ reasoning_effort }}</effort>{% endif %}"
    "{%- if enable_thinking is defined %}<think>{{ enable_thinking }}</think>{% endif %}"
    "{%- if persona is defined %}<persona>{{ persona }}</persona>{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
MAX_LEN = SimpleNamespace(max_model_len=8192)  # all build_tok_params reads of the model's config


@pytest.fixture(scope="module")
def model_dir(bundled_model_dir, tmp_path_factory):
    """The bundled model's tokenizer, adding a BOS token as Llama's does (SmolLM2's adds none)."""
    folder = tmp_path_factory.mktemp("bos_tokenizer")
    for name in ("tokenizer_config.json", "config.json"):
        shutil.copy(bundled_model_dir / name, folder / name)
    vocabulary = json.loads((bundled_model_dir / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    vocabulary["post_processor"] = {
        "type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}},
    }
    (folder / "tokenizer.json").write_text(json.dumps(vocabulary))
    return folder


@pytest.fixture(scope="module")
def vllm_tokenizer(model_dir):
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(str(model_dir))


def ours(model_dir, path, body, defaults=None):
    from atomr_infer.routing.prompt_tokens import PromptTokenizer
    from atomr_infer.wire import RoutingFacts

    files = {"tokenizer.json": (model_dir / "tokenizer.json").read_text(), "chat_template.jinja": FIELDS_TEMPLATE,
             "tokenizer_config.json": (model_dir / "tokenizer_config.json").read_text()}
    if defaults is not None:  # the server's default_chat_template_kwargs (replica/actor.py tokenizer_files)
        files["default_chat_template_kwargs.json"] = json.dumps(defaults)
    facts = RoutingFacts.of(path, {"model": "d", **body})
    return PromptTokenizer(files).tokens(facts.prompt, facts.template)


def vllms_chat(tokenizer, body, defaults=None):
    """As vLLM's chat serving renders and tokenizes it (renderers/online_renderer.py preprocess_chat,
    renderers/hf.py HfRenderer), from its own request model."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers import merge_kwargs
    from vllm.renderers.hf import safe_apply_chat_template

    request = ChatCompletionRequest.model_validate({"model": "d", **body})
    tools = None if request.tools is None else [tool.model_dump() for tool in request.tools]
    params = request.build_chat_params(FIELDS_TEMPLATE, "string").with_defaults(
        merge_kwargs(defaults, {"tools": tools, "tokenize": False}))
    text = safe_apply_chat_template(None, tokenizer, copy.deepcopy(body["messages"]),
                                    **params.get_apply_chat_template_kwargs())
    return tokenizer.encode(text, **request.build_tok_params(MAX_LEN).get_encode_kwargs())


@pytest.mark.parametrize("fields", [
    {},
    {"add_special_tokens": True},
    {"add_special_tokens": "false"},
    {"documents": [{"title": "A", "text": "alpha"}, {"title": "B", "text": "beta"}]},
    {"reasoning_effort": "low"},
    {"reasoning_effort": "none"},
    {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}},
    {"chat_template_kwargs": {"add_generation_prompt": False, "persona": "poet"}},
    {"chat_template_kwargs": {"persona": None, "enable_thinking": "auto"}},
    {"add_generation_prompt": False, "reasoning_effort": "medium", "add_special_tokens": True, "tools": TOOLS,
     "documents": [{"title": "A", "text": "alpha"}]},
], ids=lambda f: ",".join(f) or "none")
@pytest.mark.parametrize("defaults", [None, {"persona": "pirate", "enable_thinking": False}], ids=["", "defaults"])
def test_a_chat_is_tokenized_as_vllm_renders_and_tokenizes_it(model_dir, vllm_tokenizer, fields, defaults):
    """add_special_tokens, documents, reasoning_effort (and the enable_thinking it sets) were not
    rendered, and a request's own fields did not win over its chat_template_kwargs as in vLLM (an
    add_generation_prompt among them made the router give up): each such chat matched no block."""
    body = {"messages": MESSAGES, **fields}
    assert ours(model_dir, "/v1/chat/completions", body, defaults) == vllms_chat(vllm_tokenizer, body, defaults)


@pytest.mark.parametrize("fields", [{}, {"add_special_tokens": False}, {"add_special_tokens": True},
                                    {"add_special_tokens": "off"}], ids=lambda f: str(f.get("add_special_tokens")))
def test_a_completion_is_tokenized_with_the_special_tokens_it_asks_for(model_dir, vllm_tokenizer, fields):
    """The router always added the BOS token: a client sending ``add_special_tokens: false``
    (its prompt already begins with one, as a rendered chat does) never matched block 0."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    body = {"prompt": "<|endoftext|>Once upon a time", **fields}
    request = CompletionRequest.model_validate({"model": "d", **body})
    theirs = vllm_tokenizer.encode(body["prompt"], **request.build_tok_params(MAX_LEN).get_encode_kwargs())
    assert ours(model_dir, "/v1/completions", body) == theirs


def test_a_chat_bringing_its_own_template_is_not_tokenized_here(model_dir):
    """vLLM renders it with the request's template: the router's would give other ids (it now
    says it does not know them, and the request goes by prefix affinity)."""
    body = {"messages": MESSAGES, "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}
    assert ours(model_dir, "/v1/chat/completions", body) is None
    assert ours(model_dir, "/v1/chat/completions", {"messages": MESSAGES}) is not None


@pytest.mark.parametrize("extra, field", [
    ({"tokenizer": "mistralai/Mistral-7B-Instruct-v0.3"}, "extra_engine_args.tokenizer"),
    ({"tokenizer_mode": "mistral"}, "extra_engine_args.tokenizer_mode"),
    ({"tokenizer_mode": "deepseek_v32"}, "extra_engine_args.tokenizer_mode"),
])
def test_replicas_tokenizing_with_another_tokenizer_leave_routers_to_prefix_affinity(bundled_model_dir, extra,
                                                                                      field):
    """The router read the model folder's tokenizer whatever the replica was told to use: every
    prompt's ids differed from the engine's. Now the replica says so, the router tokenizes
    nothing for it, and a roll that sets or drops the override gets routers a new tokenizer."""
    from atomr_infer.engine.vllm.kv_events import renders_key
    from atomr_infer.replica.actor import tokenizer_files
    from atomr_infer.routing.prompt_tokens import PromptTokenizer
    from atomr_infer.spec import parse_deployment

    def deployment(extra_engine_args):
        return parse_deployment({"name": "x", "model": str(bundled_model_dir), "device": "cpu",
                                 "runtime_config": {"extra_engine_args": extra_engine_args}})

    files = tokenizer_files(deployment(extra))
    assert field in files["untokenizable"]
    tokenizer = PromptTokenizer(files)
    assert tokenizer.tokens("Once upon a time") is None and tokenizer.tokens(MESSAGES) is None
    assert renders_key(deployment(extra)) != renders_key(deployment({})) == ""
    own = deployment({"tokenizer": str(bundled_model_dir), "tokenizer_mode": "hf"})  # the model's own: known
    assert PromptTokenizer(tokenizer_files(own)).tokens("Once upon a time")


def test_a_roll_to_another_hub_revision_gets_routers_a_new_tokenizer() -> None:
    """Found by a review: routers key the tokenizer they fetch by the model and this fingerprint,
    which left out the revision the replica loads (``extra_engine_args.revision``): a roll from v1
    to a v2 with a fixed chat template kept v1's tokenizer in every router, and its prompts'
    blocks never matched."""
    from atomr_infer.engine.vllm.kv_events import renders_key
    from atomr_infer.spec import parse_deployment

    def deployment(**extra):
        return parse_deployment({"name": "x", "model": "org/model", "runtime_config": {"extra_engine_args": extra}})

    assert renders_key(deployment()) == ""
    assert "" != renders_key(deployment(revision="v1")) != renders_key(deployment(revision="v2")) != ""
