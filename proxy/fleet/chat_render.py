"""A chat request's template inputs as vLLM 0.32 builds them, so that a rendered prompt's tokens
are the engine's (``vllm.renderers.chat_utils`` and the Hugging Face ``apply_chat_template``).

Rules (pure: a request body in, the template's arguments out; anything malformed raises
``TypeError`` or ``ValueError``, which the tokenizer reads as "not computable"):
- Each message is rebuilt, never copied, with the fields vLLM keeps: ``role``; ``content`` as
  text parts (none for a missing or null content; a string is one part; in a list, a bare string
  or a part of type ``text`` / ``input_text`` / ``output_text`` / ``thinking`` / ``refusal``
  with its text; media parts carry no text); then ``name`` and ``task`` when strings.
  In the template's ``string`` format the parts are joined with newlines (so a null content is
  the empty string, never ``None``); in its ``openai`` format they are text-part objects.
- A system message's text part that starts with vLLM's billing-header line loses that line
  (vLLM drops it: its value changes on every request and would break the prefix).
- ``assistant``: ``tool_calls`` when not null (an empty list dropped), each call's
  ``function.arguments`` an object: a JSON string parsed, anything not an object (or not JSON,
  or empty) ``{}``; ``reasoning`` kept, also as ``reasoning_content``.
- ``tool``: ``tool_call_id``; content made of text parts only is one string.
- ``developer``: ``tools`` (null when absent).
- The request's ``tools`` as vLLM's model dumps them: ``type``, ``function`` with ``name``,
  ``description`` and ``parameters`` (null when absent), ``strict`` and ``defer_loading`` only when
  set; unknown keys dropped.
- Template variables: ``chat_template_kwargs`` (those the template reads), overridden by the
  request's ``add_generation_prompt`` (default true), ``continue_final_message``, ``documents`` and
  ``reasoning_effort`` (null and ``"auto"`` leave a kwarg as given); ``enable_thinking`` follows
  ``reasoning_effort`` unless the kwargs set it. Both generation flags true is an error.
- ``continue_final_message``: the final message's last text is marked, the chat rendered and cut at
  the mark (``continue_text``), as transformers does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

BILLING_HEADER = "x-anthropic-billing-header"
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_TEXT_KEYS = {"text": "text", "input_text": "text", "output_text": "text",
              "thinking": "thinking", "refusal": "refusal"}
# ``apply_chat_template``'s own parameters: never template variables from the kwargs.
_CONSUMED = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
_UNSET = (None, "auto")


def text_parts(content: object) -> list[str]:
    """The texts of a message's content, in order (module rules)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise TypeError("message content is neither text nor a list of parts")
    out: list[str] = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, dict):
            key = _TEXT_KEYS.get(part.get("type"))  # type: ignore[arg-type]
            text = part.get(key) if key is not None else None
            if isinstance(text, str):
                out.append(text)
    return out


def _without_billing_header(parts: list[str]) -> list[str]:
    out: list[str] = []
    for text in parts:
        if not text.startswith(BILLING_HEADER):
            out.append(text)
        elif rest := text.partition("\n")[2]:
            out.append(rest)
    return out


def _arguments(value: object) -> dict[str, Any]:
    if not value:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return {}
    return value if isinstance(value, dict) else {}


def _tool_calls(calls: object) -> list[Any] | None:
    if not isinstance(calls, list):
        raise TypeError("tool_calls is not a list")
    if not calls:
        return None
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise TypeError("a tool call is not a function call")
        out.append({**call, "function": {**function,
                                         "arguments": _arguments(function.get("arguments"))}})
    return out


def message(raw: object, openai_format: bool) -> dict[str, Any]:
    """One message as vLLM hands it to the template (module rules)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("role"), str):
        raise TypeError("a message is not an object with a role")
    role = raw["role"]
    parts = text_parts(raw.get("content"))
    if role == "system":
        parts = _without_billing_header(parts)
    out: dict[str, Any] = {"role": role}
    out["content"] = ([{"type": "text", "text": t} for t in parts] if openai_format
                      else "\n".join(parts))
    if role == "assistant":
        if raw.get("tool_calls") is not None:
            calls = _tool_calls(raw["tool_calls"])
            if calls is not None:
                out["tool_calls"] = calls
        if raw.get("reasoning") is not None:
            out["reasoning"] = out["reasoning_content"] = raw["reasoning"]
    elif role == "tool":
        if "tool_call_id" in raw:
            out["tool_call_id"] = raw["tool_call_id"]
        if openai_format:
            out["content"] = "\n".join(parts)
    for key in ("name", "task"):
        if isinstance(raw.get(key), str):
            out[key] = raw[key]
    if role == "developer":
        out["tools"] = raw.get("tools")
    return out


def tool(raw: object) -> dict[str, Any]:
    """One entry of the request's ``tools`` as vLLM dumps it (module rules)."""
    if not isinstance(raw, dict) or not isinstance(function := raw.get("function"), dict) \
            or not isinstance(function.get("name"), str):
        raise TypeError("a tool is not a named function")
    defer = raw.get("defer_loading")
    out_fn: dict[str, Any] = {"name": function["name"],
                              "description": function.get("description"),
                              "parameters": function.get("parameters")}
    if function.get("strict") is not None:
        out_fn["strict"] = function["strict"]
    fn_defer = function.get("defer_loading")
    if fn_defer is None:
        fn_defer = defer
    if fn_defer is not None:
        out_fn["defer_loading"] = fn_defer
    out: dict[str, Any] = {"type": "function", "function": out_fn}
    if defer is not None:
        out["defer_loading"] = defer
    return out


def template_kwargs(body: Mapping[str, Any], variables: frozenset[str]) -> dict[str, Any]:
    """The template's variables besides ``messages`` and ``tools`` (module rules)."""
    given = body.get("chat_template_kwargs")
    if given is not None and not isinstance(given, dict):
        raise TypeError("chat_template_kwargs is not an object")
    user = dict(given or {})
    generation = body.get("add_generation_prompt", True)
    proceed = body.get("continue_final_message", False)
    if generation is True and proceed is True:
        raise ValueError("continue_final_message and add_generation_prompt both set")
    effort = body.get("reasoning_effort")
    overrides: dict[str, Any] = {"add_generation_prompt": generation,
                                 "continue_final_message": proceed,
                                 "documents": body.get("documents"), "reasoning_effort": effort}
    if effort is not None and "enable_thinking" not in user:
        overrides["enable_thinking"] = effort != "none"
    merged = user | {k: v for k, v in overrides.items() if v not in _UNSET}
    out = {k: v for k, v in merged.items() if k in variables and k not in _CONSUMED}
    out["add_generation_prompt"] = merged.get("add_generation_prompt") is not False
    out["documents"] = merged.get("documents")
    return out


def mark_final(messages: list[dict[str, Any]]) -> str:
    """For ``continue_final_message``: append the mark to the final message's last text; returns
    that text as it was."""
    if not messages:
        raise ValueError("no final message to continue")
    content = messages[-1].get("content")
    if isinstance(content, str):
        messages[-1]["content"] = content + CONTINUE_TAG
        return content
    for part in reversed(content if isinstance(content, list) else []):
        if isinstance(part, dict) and "text" in part:
            text = str(part["text"])
            part["text"] = text + CONTINUE_TAG
            return text
    raise ValueError("the final message has no text to continue")


def continue_text(rendered: str, final: str) -> str:
    """The rendered chat cut where the final message's text ends (transformers' rule)."""
    tag = CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ValueError("the template dropped the final message's text")
    at = rendered.rindex(tag)
    if rendered[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()
