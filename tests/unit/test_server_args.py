"""``serving.openai.server_args``: `vllm serve`'s options for the model's server, checked by name at
apply (vLLM's source read, not imported) and by value on the replica (vLLM's own parser), before
the model is fetched; what the spec or `atomr serve` sets otherwise is refused at parse."""

from __future__ import annotations

import pytest

from atomr_infer.engine.vllm.engine_args import check_server_options
from atomr_infer.engine.vllm.openai_app import serve_args
from atomr_infer.engine.vllm.spec_check import check_spec
from atomr_infer.errors import SpecError
from atomr_infer.spec import parse_deployment


def spec(**server_args):
    return parse_deployment({"name": "x", "model": "/models/x", "device": "cpu",
                             "serving": {"openai": {"server_args": server_args}}})


def test_server_args_are_parsed_as_vllm_serve_parses_its_command_line():
    args = serve_args(spec(default_chat_template_kwargs={"enable_thinking": False}, response_role="-bot-",
                           enable_prompt_tokens_details=True, return_tokens_as_token_ids=False,
                           sse_keep_alive_interval=15), "/models/x")
    assert args.default_chat_template_kwargs == {"enable_thinking": False}
    assert (args.response_role, args.enable_prompt_tokens_details) == ("-bot-", True)  # (no flag: a value)
    assert (args.return_tokens_as_token_ids, args.sse_keep_alive_interval) == (False, 15)
    assert args.served_model_name == ["x"]


def test_a_misspelt_option_is_refused_at_apply_and_on_the_replica_not_taken_as_a_prefix():
    for check in (check_spec, check_server_options):
        with pytest.raises(SpecError, match=r"server_args.response_rol: not an option of vLLM's OpenAI server "
                                            r"\(did you mean 'response_role'\?\)"):
            check(spec(response_rol="bot"))


def test_a_value_vllm_refuses_is_refused_on_the_replica_in_one_line():
    with pytest.raises(SpecError) as caught:
        check_server_options(spec(chat_template_content_format="bogus"))
    message = str(caught.value)
    assert "serving.openai.server_args: vLLM's server refuses them: argument --chat-template-content-format: " \
           "invalid choice: 'bogus'" in message and "\n" not in message


@pytest.mark.parametrize(("key", "says"), [
    ("chat_template", "set serving.openai.chat_template instead"),
    ("served_model_name", "set serving.openai.served_model_name instead"),
    ("port", "`atomr serve` runs the HTTP server: `atomr serve --port` sets it"),
    ("api_key", "`atomr serve` runs the HTTP server: `atomr serve --api-keys FILE` .a YAML file of keys."),
    ("ssl_keyfile", "`atomr serve` runs the HTTP server \\(its flags"),
    ("enable_request_id_headers", "`atomr serve` runs the HTTP server: `atomr serve --enable-request-id-headers`"),
    ("allowed_origins", "`atomr serve` runs the HTTP server: `atomr serve --allowed-origins`"),
])
def test_what_the_spec_or_atomr_serve_sets_is_refused_at_parse(key, says):
    with pytest.raises(SpecError, match=f"server_args: {key}: {says}"):
        spec(**{key: "v"})


def test_an_inline_chat_template_longer_than_a_file_name_goes_to_the_routers(bundled_model_dir):
    """Routers render chats with the server's template (kv_events); one written inline, longer than
    the OS takes for a file name, raised OSError where it was tried as a path."""
    from atomr_infer.replica.actor import tokenizer_files

    inline = "{% for m in messages %}" + "{{ m['content'] }}" * 40 + "{% endfor %}"
    deployment = parse_deployment({"name": "x", "model": str(bundled_model_dir), "device": "cpu",
                                   "serving": {"openai": {"chat_template": inline}}})
    assert tokenizer_files(deployment)["chat_template.jinja"] == inline
