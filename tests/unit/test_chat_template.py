"""A chat template that fails at serve time: the server's fault (500 naming the template)
unless the template refuses the client's messages on purpose (400 on `messages`)."""

from __future__ import annotations

import json

import pytest

from handlers.api.chat_template import render_chat, template_name
from handlers.api.openai import ChatCompletionsApi
from handlers.errors import RequestError
from tests.unit.test_generation_handler import answer
from tests.unit.test_openai_api import make_service, make_tokenizer

CHAT = [{"role": "user", "content": "hi there"}]
BROKEN = {  # what a template does wrong -> what the message says
    "{% for m in messages %}{{ m['content'] }}}{% endfor %}{% endif %}": "TemplateSyntaxError",
    "{{ messages[0]['content'] + 1 }}": "TypeError",
    "{{ messages[0]['content'] | no_such_filter }}": "TemplateAssertionError",
    "{{ messages[0].content.nope.deeper }}": "UndefinedError",
}
REFUSES = ("{% if messages[0]['role'] != 'system' %}"
           "{{ raise_exception('the first message must be a system message') }}{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def chat(tokenizer, template: str, body: dict | None = None):
    service = make_service(tokenizer, chat_template=template)
    return ChatCompletionsApi().prepare({"messages": CHAT, **(body or {})}, "", service)


@pytest.mark.parametrize("template, kind", list(BROKEN.items()))
def test_a_template_that_fails_is_a_500_naming_the_template(tokenizer, template, kind) -> None:
    with pytest.raises(RequestError) as err:
        chat(tokenizer, template)
    assert err.value.status == 500 and err.value.field == ""  # no client field to blame
    assert err.value.message.startswith("the model's chat template failed: ")
    assert kind in err.value.message and "handler.chat_template, inline Jinja" in err.value.message


def test_a_tools_request_on_a_template_that_does_not_compile_is_the_servers_fault(
        tokenizer) -> None:
    """The tool-format probe renders the same broken template: a 500, not a 400 blaming
    tool_choice."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with pytest.raises(RequestError) as err:
        chat(tokenizer, next(iter(BROKEN)), {"tools": tools, "tool_choice": "required"})
    assert err.value.status == 500 and "TemplateSyntaxError" in err.value.message


def test_a_template_that_refuses_the_messages_is_the_clients_400(tokenizer) -> None:
    with pytest.raises(RequestError) as err:
        chat(tokenizer, REFUSES)
    assert (err.value.status, err.value.field) == (400, "messages")
    assert "must be a system message" in err.value.message
    ok = chat(tokenizer, REFUSES, {"messages": [{"role": "system", "content": "be brief"},
                                                 *CHAT]})
    assert ok.request.prompt == ""  # it renders nothing, and refuses nothing


def test_the_message_names_which_template(tokenizer) -> None:
    assert template_name("llama-2") == "handler.chat_template preset 'llama-2'"
    assert template_name("chat.jinja") == "handler.chat_template file 'chat.jinja'"
    assert "tokenizer_config.json" in template_name("")
    tok = make_tokenizer()
    tok.chat_template = "{{ messages[0]['content'] + 1 }}"  # the checkpoint's own
    with pytest.raises(RequestError) as err:
        render_chat(tok, CHAT)
    assert err.value.status == 500 and "tokenizer_config.json" in err.value.message


def test_through_the_handler_a_broken_template_is_an_openai_500(monkeypatch) -> None:
    """As the client sees it through TorchServe's worker side: a complete 500 in OpenAI's
    shape, type server_error, no param."""
    from tests.unit import test_generation_handler as h

    real = h.FakeService.__init__

    def with_template(self, *args, **kwargs):
        real(self, *args, **kwargs)
        broken = make_service(make_tokenizer(), chat_template=next(iter(BROKEN)))
        self.config, self.tokenizer = broken.config, broken.tokenizer

    monkeypatch.setattr(h.FakeService, "__init__", with_template)
    view = answer({"messages": CHAT}, url_path="v1/chat/completions")
    assert (view.status, view.complete, view.forgotten) == (500, True, True)
    error = json.loads(view.body)["error"]
    assert error["type"] == "server_error" and error["param"] is None
    assert error["message"].startswith("the model's chat template failed: TemplateSyntaxError")
