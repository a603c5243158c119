"""A chat request's template inputs as vLLM builds them (``proxy.fleet.chat_render``), and the
pool tokenizer rendering with them; real vLLM's tokens for the same requests are checked in
``tests/contract/test_precise_routing.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizer_files import make_tokenizer_dir

from proxy.core.errors import ConfigError
from proxy.fleet import chat_render
from proxy.fleet.tokenizer import PromptTokenizer, load_tokenizer

CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}


def test_a_null_content_is_the_empty_string_in_the_string_format_and_no_parts_in_openai() -> None:
    raw = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    assert chat_render.message(raw, openai_format=False)["content"] == ""
    assert chat_render.message(raw, openai_format=True)["content"] == []


def test_tool_call_arguments_reach_the_template_as_objects_and_the_request_is_untouched() -> None:
    raw = {"role": "assistant", "content": "", "tool_calls": [CALL]}
    out = chat_render.message(raw, openai_format=False)
    assert out["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert CALL["function"]["arguments"] == '{"x": 1}'
    for bad in ("not json", "[1, 2]", "", None, 7):
        call = {"type": "function", "function": {"name": "f", "arguments": bad}}
        got = chat_render.message({"role": "assistant", "tool_calls": [call]}, False)
        assert got["tool_calls"][0]["function"]["arguments"] == {}
    empty = chat_render.message({"role": "assistant", "content": "x", "tool_calls": []}, False)
    assert "tool_calls" not in empty
    with pytest.raises(TypeError):
        chat_render.message({"role": "assistant", "tool_calls": ["no"]}, False)


def test_only_the_fields_vllm_keeps_reach_the_template() -> None:
    raw = {"role": "tool", "content": [{"type": "text", "text": "a"}, "b"],
           "tool_call_id": "c1", "name": "f", "extra": "dropped", "task": 3}
    assert chat_render.message(raw, openai_format=True) == {
        "role": "tool", "content": "a\nb", "tool_call_id": "c1", "name": "f"}
    thinking = {"role": "assistant", "content": [{"type": "thinking", "thinking": "t"},
                                                 {"type": "refusal", "refusal": "r"},
                                                 {"type": "image_url", "image_url": {"url": "u"}}],
                "reasoning": "why"}
    assert chat_render.message(thinking, openai_format=False) == {
        "role": "assistant", "content": "t\nr", "reasoning": "why", "reasoning_content": "why"}
    system = {"role": "system", "content": "x-anthropic-billing-header: cch=1\nbe brief"}
    assert chat_render.message(system, False)["content"] == "be brief"
    with pytest.raises(TypeError):
        chat_render.message({"content": "no role"}, False)


def test_tools_are_dumped_with_vllms_fields_in_vllms_order() -> None:
    raw = {"type": "function", "unknown": 1,
           "function": {"parameters": {"type": "object"}, "name": "f", "other": 2}}
    assert json.dumps(chat_render.tool(raw)) == json.dumps(
        {"type": "function", "function": {"name": "f", "description": None,
                                          "parameters": {"type": "object"}}})
    deferred = chat_render.tool({"function": {"name": "g", "strict": True},
                                 "defer_loading": True})
    assert deferred == {"type": "function", "defer_loading": True, "function": {
        "name": "g", "description": None, "parameters": None, "strict": True,
        "defer_loading": True}}


def test_template_kwargs_pass_what_the_template_reads_and_the_request_overrides() -> None:
    reads = frozenset({"enable_thinking", "mood", "add_generation_prompt", "messages"})
    body = {"chat_template_kwargs": {"mood": "calm", "unread": 1, "messages": [],
                                     "add_generation_prompt": True},
            "add_generation_prompt": False}
    assert chat_render.template_kwargs(body, reads) == {
        "mood": "calm", "add_generation_prompt": False, "documents": None}
    effort = chat_render.template_kwargs({"reasoning_effort": "none"}, reads)
    assert effort["enable_thinking"] is False and effort["add_generation_prompt"] is True
    kept = chat_render.template_kwargs(
        {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}, reads)
    assert kept["enable_thinking"] is False
    with pytest.raises(ValueError):
        chat_render.template_kwargs({"continue_final_message": True}, reads)
    with pytest.raises(TypeError):
        chat_render.template_kwargs({"chat_template_kwargs": "x"}, reads)


TOOL_TEMPLATE = (
    "{% if tools %}<|system|>{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if not enable_thinking %}no thinking"
    "{% endif %}{% endif %}")


def _tokenizer(tmp_path: Path, template: str) -> PromptTokenizer:
    (make_tokenizer_dir(tmp_path) / "chat_template.jinja").write_text(template)
    return load_tokenizer(str(tmp_path), "f")


def _text(tok: PromptTokenizer, body: dict[str, object]) -> str:
    ids = tok.request_ids(True, body)
    assert ids is not None
    return tok._tok.decode(ids, skip_special_tokens=False)


def test_the_tokenizer_renders_agent_traffic_as_vllm_builds_it(tmp_path: Path) -> None:
    tok = _tokenizer(tmp_path, TOOL_TEMPLATE)
    body = {"messages": [{"role": "user", "content": "the router"},
                         {"role": "assistant", "content": None, "tool_calls": [CALL]},
                         {"role": "tool", "content": "ok", "tool_call_id": "c1"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "chat_template_kwargs": {"enable_thinking": True}}
    assert _text(tok, body) == (
        '<|system|>[{"type": "function", "function": {"name": "f", "description": null, '
        '"parameters": null}}]\n<|user|>the router<|assistant|>f{"x": 1}<|tool|>ok<|assistant|>')


def test_continue_final_message_cuts_the_render_after_the_final_text(tmp_path: Path) -> None:
    tok = _tokenizer(tmp_path, TOOL_TEMPLATE)
    body = {"messages": [{"role": "user", "content": "the router"},
                         {"role": "assistant", "content": "the engine "}],
            "add_generation_prompt": False, "continue_final_message": True}
    assert _text(tok, body) == "<|user|>the router<|assistant|>the engine "
    assert tok.request_ids(True, {**body, "add_generation_prompt": True}) is None


@pytest.mark.parametrize(("template", "why"), [
    ("{% for m in messages %}{{ m.content ", "does not compile"),
    ("{% if %}", "does not compile"),
])
def test_a_chat_template_that_does_not_compile_is_a_config_error(
        tmp_path: Path, template: str, why: str) -> None:
    with pytest.raises(ConfigError) as err:
        _tokenizer(tmp_path, template)
    assert err.value.field == "f" and why in str(err.value)


def test_a_chat_template_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    make_tokenizer_dir(tmp_path)
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(ConfigError) as err:
        load_tokenizer(str(tmp_path), "pools[0].tokenizer")
    assert err.value.field == "pools[0].tokenizer" and "UTF-8" in str(err.value)
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    with pytest.raises(ConfigError):
        load_tokenizer(str(tmp_path), "pools[0].tokenizer")
