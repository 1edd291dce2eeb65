"""Which chat template renders a request, and with which variables (vLLM: renderers/hf.py).

A request may bring its own Jinja template (`chat_template`, or
`chat_template_kwargs.chat_template`) only when the server runs with
--trust-request-chat-template (vLLM's flag and message): a template is code that
runs on the server, and it decides what the model sees.

`chat_template_kwargs` become template variables (e.g. a template's
`enable_thinking`). As in vLLM (resolve_chat_template_kwargs), only variables the
template reads are passed on (others could not change the prompt) and `tokenize` is
refused; the request's own fields (add_generation_prompt, continue_final_message,
documents) override the same names in chat_template_kwargs.
"""
from __future__ import annotations

import functools
from typing import Any

from vllm_anatomy.exceptions import VLLMValidationError

# Names the renderer itself passes to the template: never taken from chat_template_kwargs.
_RENDERER_VARIABLES = frozenset({"messages", "conversation", "tools", "add_generation_prompt",
                                 "continue_final_message"})


def validate_chat_template(request_chat_template: str | None, chat_template_kwargs: dict[str, Any] | None,
                           trust_request_chat_template: bool) -> None:
    """vLLM's check of the same name: a request's own template needs the server's trust."""
    if not trust_request_chat_template and (
            request_chat_template is not None
            or (chat_template_kwargs and chat_template_kwargs.get("chat_template") is not None)):
        raise VLLMValidationError("Chat template is passed with request, but --trust-request-chat-template is "
                                  "not set. Refused request with untrusted chat template.",
                                  parameter="chat_template")


@functools.lru_cache(maxsize=16)
def template_variables(chat_template: str) -> frozenset[str]:
    """The variables a Jinja template reads (jinja2.meta, as vLLM)."""
    import jinja2
    import jinja2.meta
    return frozenset(jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(chat_template)))


def resolve_chat_template(tokenizer, request_chat_template: str | None,
                          chat_template_kwargs: dict[str, Any] | None) -> tuple[str | None, dict[str, Any]]:
    """(the template to render with, or None for the tokenizer's; the extra template variables)."""
    kwargs = dict(chat_template_kwargs or {})
    if "tokenize" in kwargs:
        raise VLLMValidationError("Found unexpected chat template kwargs from request: {'tokenize'}",
                                  parameter="chat_template_kwargs")
    template = request_chat_template or kwargs.pop("chat_template", None)
    source = template if template is not None else tokenizer.chat_template
    if not kwargs or not isinstance(source, str):
        return template, {}
    used = template_variables(source) - _RENDERER_VARIABLES
    return template, {k: v for k, v in kwargs.items() if k in used}
