"""How chat request fields shape the prompt (issue 29, F5), with the default model's tokenizer:
continue_final_message, echo, chat_template_kwargs, documents, add_special_tokens, and a
request's own chat_template (only with --trust-request-chat-template, as vLLM)."""
from __future__ import annotations

import types

import pytest

from vllm_anatomy.entrypoints.openai.chat_protocol import ChatCompletionRequest
from vllm_anatomy.entrypoints.openai.chat_template import resolve_chat_template, validate_chat_template
from vllm_anatomy.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm_anatomy.entrypoints.openai.serving_models import BaseModelPath, OpenAIServingModels
from vllm_anatomy.exceptions import VLLMValidationError

pytestmark = pytest.mark.model

CONVERSATION = [{"role": "user", "content": "Name a color."},
                {"role": "assistant", "content": "My favourite color is"}]


@pytest.fixture(scope="module")
def chat(default_model_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    engine = types.SimpleNamespace(get_tokenizer=lambda: tok, input_processor=None,
                                   model_config=types.SimpleNamespace(max_model_len=2048))
    models = OpenAIServingModels([BaseModelPath("smol", default_model_dir)], 2048)
    return OpenAIServingChat(engine, models)


def render(chat: OpenAIServingChat, **fields) -> str:
    return chat._render_chat(ChatCompletionRequest(**{"messages": CONVERSATION, **fields}))[0]


def test_continue_final_message_leaves_the_last_message_open(chat):
    closed = render(chat, add_generation_prompt=False)
    open_ = render(chat, add_generation_prompt=False, continue_final_message=True)
    assert open_.endswith("My favourite color is") and not closed.endswith("My favourite color is")
    assert closed.startswith(open_)      # the same prompt, minus the end of the assistant's turn


def test_continue_final_message_needs_add_generation_prompt_off():
    with pytest.raises(VLLMValidationError, match="add_generation_prompt") as info:
        ChatCompletionRequest(messages=CONVERSATION, continue_final_message=True).check_unsupported()
    assert info.value.parameter == "continue_final_message"


def test_echo_prepends_the_assistants_last_message_only(chat):
    assert chat._echo_text(ChatCompletionRequest(messages=CONVERSATION, echo=True)) == "My favourite color is"
    assert chat._echo_text(ChatCompletionRequest(messages=CONVERSATION[:1], echo=True)) == ""
    assert chat._echo_text(ChatCompletionRequest(messages=CONVERSATION)) == ""


def test_template_variables_come_from_chat_template_kwargs(chat):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}{% if shout %}!!{% endif %}"
    tok = chat.tokenizer
    _, kwargs = resolve_chat_template(tok, template, {"shout": True, "unused": 1})
    assert kwargs == {"shout": True}         # a variable the template does not read changes nothing
    with pytest.raises(VLLMValidationError, match="tokenize"):
        resolve_chat_template(tok, None, {"tokenize": True})
    # The request's template (trusted) and its variable, end to end.
    assert render(chat, chat_template=template, chat_template_kwargs={"shout": True},
                  add_generation_prompt=False) == "Name a color.My favourite color is!!"
    via_kwargs = render(chat, chat_template_kwargs={"chat_template": template}, add_generation_prompt=False)
    assert via_kwargs == "Name a color.My favourite color is"


def test_a_request_template_needs_trust():
    for template, kwargs in (("{{ 'x' }}", None), (None, {"chat_template": "{{ 'x' }}"})):
        with pytest.raises(VLLMValidationError, match="--trust-request-chat-template") as info:
            validate_chat_template(template, kwargs, trust_request_chat_template=False)
        assert info.value.parameter == "chat_template"
        validate_chat_template(template, kwargs, trust_request_chat_template=True)
    validate_chat_template(None, {"enable_thinking": False}, trust_request_chat_template=False)


def test_documents_and_message_fields_reach_the_template(chat):
    template = ("{% for d in documents %}[{{ d.title }}]{% endfor %}"
                "{% for m in messages %}{{ m.name or '' }}:{{ m.content }};{% endfor %}")
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi", "name": "ann"}],
                                    documents=[{"title": "doc1", "text": "..."}], chat_template=template,
                                    add_generation_prompt=False)
    assert chat._render_chat(request)[0] == "[doc1]ann:hi;"


def test_add_special_tokens(chat):
    plain = chat._render_chat(ChatCompletionRequest(messages=CONVERSATION))[1]
    special = chat._render_chat(ChatCompletionRequest(messages=CONVERSATION, add_special_tokens=True))[1]
    tok = chat.tokenizer
    assert special == tok.encode(tok.decode(plain), add_special_tokens=True)
