"""OpenAI request parsing, chat templates and SSE framing: pure and fast (no server, no model)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from handlers.api.chat_template import LLAMA2_CHAT, encode_chat, render_chat, resolve_template
from handlers.api.native import Immediate
from handlers.api.openai import (
    ChatCompletionsApi,
    CompletionsApi,
    ModelsApi,
    UnknownEndpoint,
    served_name,
)
from handlers.api.openai_framing import (
    DONE,
    OpenAIErrorFramer,
    OpenAIJsonFramer,
    OpenAISseFramer,
    ResponseMeta,
)
from handlers.api.routes import select_api
from handlers.backends import capabilities_for
from handlers.config import parse_config
from handlers.engine.messages import ModelLimits
from handlers.engine.scheduler import FinishEvent
from handlers.errors import RequestError

WORDS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "<<SYS>>", "<</SYS>>", "hi", "there",
         "be", "brief", "ok"]


def make_tokenizer():
    """A word-level tokenizer that adds BOS by itself, like Llama's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def make_service(tokenizer, max_length: int = 64, **handler):
    config = parse_config({"handler": {"max_length": max_length, "max_new_tokens_limit": 32,
                                       "defaults": {"max_new_tokens": 8}, **handler}})
    caps = capabilities_for(config.handler)  # what the loaded backend would declare
    return SimpleNamespace(config=config, tokenizer=tokenizer,
                           limits=ModelLimits(1, max_length, None, caps),
                           encode=lambda p: list(tokenizer(p)["input_ids"]))


@pytest.fixture
def service(tokenizer):
    return make_service(tokenizer)


CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
LLAMA2_TEXT = "<s>[INST] <<SYS>>\nbe brief\n<</SYS>>\n\nhi there [/INST]"


def rejects(api, body: dict, service, param: str, status: int = 400) -> RequestError:
    with pytest.raises(RequestError) as info:
        api.prepare(body, "application/json", service)
    assert (info.value.field, info.value.status) == (param, status), info.value
    return info.value


# --- routing and request mapping ---

def test_select_api_routes_v1_paths() -> None:
    assert isinstance(select_api("v1/completions"), CompletionsApi)
    assert isinstance(select_api("/v1/chat/completions/"), ChatCompletionsApi)
    assert isinstance(select_api("v1/models"), ModelsApi)
    assert isinstance(select_api("v1/embeddings"), UnknownEndpoint)


def test_unknown_endpoint_is_404(service) -> None:
    err = rejects(select_api("v1/embeddings"), {}, service, "", 404)
    assert "v1/chat/completions" in err.message


def test_completion_maps_openai_fields_onto_the_native_request(service) -> None:
    body = {"model": "model", "prompt": "hi there", "max_tokens": 5, "temperature": 0.5,
            "top_p": 0.9,
            "stop": ["ok"], "seed": 3, "frequency_penalty": 0, "presence_penalty": 0.0,
            "user": "u1", "logprobs": None, "n": 1, "echo": False, "best_of": None}
    prepared = CompletionsApi().prepare(body, "application/json", service)
    r = prepared.request
    assert (r.prompt, r.max_new_tokens, r.stop, r.stream) == ("hi there", 5, ("ok",), False)
    assert (r.sampling.temperature, r.sampling.top_p, r.sampling.seed) == (0.5, 0.9, 3)
    assert prepared.prompt_ids == [1, 7, 8]
    assert isinstance(prepared.framer, OpenAIJsonFramer)
    assert prepared.framer.meta.model == "model" and prepared.framer.meta.id.startswith("cmpl-")


def test_stream_and_defaults_follow_openai_not_the_native_config(service) -> None:
    prepared = CompletionsApi().prepare(b'{"prompt": ["hi"], "stream": true}', "", service)
    assert prepared.request.stream and prepared.request.max_new_tokens == 8
    assert isinstance(prepared.framer, OpenAISseFramer)
    plain = CompletionsApi().prepare({"prompt": "hi"}, "application/json", service)
    assert plain.request.stream is False  # native default is true


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "n": 2}, "n"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -(2**31)}, "max_tokens"),  # 2**31: capped now
    ({"prompt": "hi " * 50, "max_tokens": 20}, "max_tokens"),
    ({"prompt": "hi", "min_tokens": 99}, "min_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "frequency_penalty": 2.5}, "frequency_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "logprobs": True}, "logprobs"),
    ({"prompt": "hi", "logprobs": 1, "stream": True}, "logprobs"),
    ({"prompt": "hi", "echo": 1}, "echo"),
    ({"prompt": "hi", "ignore_eos": "yes"}, "ignore_eos"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "stream": True, "stream_options": {"bogus": 1}}, "stream_options"),
    ({"prompt": "hi", "model": 3}, "model"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [[1, 2], [3]]}, "prompt"),
    ({"prompt": [1, 99]}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "hi", "messages": []}, "messages"),
])
def test_completion_rejections_name_the_openai_field(service, body, param) -> None:
    rejects(CompletionsApi(), body, service, param)


def test_unknown_field_suggests_the_closest(service) -> None:
    err = rejects(CompletionsApi(), {"prompt": "hi", "temprature": 0}, service, "temprature")
    assert "'temperature'" in err.message


def test_prompt_that_does_not_fit_names_max_tokens(tokenizer) -> None:
    small = make_service(tokenizer, max_length=40)
    err = rejects(CompletionsApi(), {"prompt": "hi " * 30, "max_tokens": 20}, small, "max_tokens")
    assert "max_length 40" in err.message


def test_malformed_json_is_an_error_without_param(service) -> None:
    err = rejects(CompletionsApi(), b'{"prompt": ', service, "")
    body = json.loads(OpenAIErrorFramer().error(err.status, err.message, err.field))
    assert body["error"]["param"] is None and "malformed JSON" in body["error"]["message"]
    rejects(CompletionsApi(), b"", service, "")


# --- chat ---

def test_chat_renders_the_template_without_a_second_bos(tokenizer) -> None:
    prepared = ChatCompletionsApi().prepare({"messages": CHAT, "stream": True,
                                             "stream_options": {"include_usage": True}},
                                            "application/json",
                                            make_service(tokenizer, chat_template="llama-2"))
    assert prepared.prompt_ids.count(1) == 1 and prepared.prompt_ids[0] == 1
    assert prepared.framer.meta.chat and prepared.framer.meta.include_usage


def test_llama2_preset_renders_the_llama2_format(tokenizer) -> None:
    assert render_chat(tokenizer, CHAT, "llama-2") == LLAMA2_TEXT
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": "there"}]
    assert render_chat(tokenizer, turns, "llama-2") == \
        "<s>[INST] hi [/INST] ok </s><s>[INST] there [/INST]"


def test_llama3_preset_renders_the_llama3_instruct_format(tokenizer) -> None:
    """The Llama-3 / 3.1 Instruct layout: BOS once, header blocks ended by <|eot_id|>, an
    open assistant header last (the generation prompt)."""
    assert render_chat(tokenizer, CHAT, "llama-3") == (
        "<s><|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize("preset, start, end", [
    ("qwen2.5", "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi there<|im_end|>",
     "<|im_start|>assistant\n"),
    ("qwen3", "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi there<|im_end|>",
     "<|im_start|>assistant\n"),
    ("mistral", "<s>[INST] be brief\n\nhi there[/INST]", "[/INST]"),
])
def test_published_presets_render_their_families_format(tokenizer, preset, start, end) -> None:
    """Qwen2.5's, Qwen3's and Mistral v0.3's own templates, for checkpoints saved without
    theirs (read from handlers/presets/templates/ when first used)."""
    text = render_chat(tokenizer, CHAT, preset)
    assert text.startswith(start) and text.endswith(end)


def test_configured_template_overrides_the_tokenizers(tokenizer) -> None:
    tok = make_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    assert render_chat(tok, CHAT) == "be brief|hi there|"
    assert render_chat(tok, CHAT, "llama-2") == LLAMA2_TEXT
    assert render_chat(tok, CHAT, "{{ messages[-1]['content'] }}") == "hi there"


def test_template_file_is_read_from_the_checkpoint_dir(tmp_path) -> None:
    (tmp_path / "chat.jinja").write_text(LLAMA2_CHAT)
    assert resolve_template("chat.jinja", str(tmp_path)) == LLAMA2_CHAT
    with pytest.raises(FileNotFoundError, match="llama-2"):
        resolve_template("nope.jinja", str(tmp_path))


def test_a_model_without_a_chat_template_answers_chat_with_a_400_and_the_fix(tokenizer) -> None:
    """A base model needs no template: chat is refused for the request (a 400 naming the
    preset to set, or completions to use), not failed as a server error."""
    tok = make_tokenizer()
    with pytest.raises(RequestError, match="handler.chat_template") as info:
        render_chat(tok, CHAT)
    assert info.value.status == 400 and "/v1/completions" in info.value.message


def test_template_exceptions_are_400_on_messages(service) -> None:
    bad = [{"role": "user", "content": "hi"}, {"role": "user", "content": "there"}]
    s = make_service(service.tokenizer, chat_template="llama-2")
    err = rejects(ChatCompletionsApi(), {"messages": bad}, s, "messages")
    assert "alternate" in err.message


@pytest.mark.parametrize("body, param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]},
     "messages[0].tool_calls"),
    ({"messages": CHAT, "n": 2}, "n"),
    ({"messages": CHAT, "max_tokens": -1}, "max_tokens"),
    ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": CHAT, "max_completion_tokens": 4, "max_tokens": 5}, "max_completion_tokens"),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": CHAT, "tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"messages": CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "schema": {}}}}, "response_format.json_schema.name"),
])
def test_chat_rejections_name_the_openai_field(tokenizer, body, param) -> None:
    rejects(ChatCompletionsApi(), body, make_service(tokenizer, chat_template="llama-2"), param)


def test_chat_accepts_text_parts_and_harmless_fields(tokenizer) -> None:
    s = make_service(tokenizer, chat_template="llama-2")
    body = {"messages": [{"role": "developer", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi there"}],
                          "name": "ann"}],
            "max_completion_tokens": 4, "tools": [], "tool_choice": "none", "store": False,
            "response_format": {"type": "text"}, "logprobs": False, "top_logprobs": None}
    prepared = ChatCompletionsApi().prepare(body, "application/json", s)
    assert prepared.request.prompt == LLAMA2_TEXT and prepared.request.max_new_tokens == 4


def test_long_chat_names_messages(tokenizer) -> None:
    s = make_service(tokenizer, max_length=40, chat_template="llama-2")
    rejects(ChatCompletionsApi(), {"messages": [{"role": "user", "content": "hi " * 50}],
                                   "max_tokens": 1}, s, "messages")


def test_encode_chat_adds_bos_only_when_the_text_lacks_it(tokenizer) -> None:
    assert encode_chat(tokenizer, "<s> hi")[:2] == [1, 7]
    assert encode_chat(tokenizer, "hi") == [1, 7]


# --- models ---

def test_models_lists_the_archive_name(tmp_path) -> None:
    (tmp_path / "MAR-INF").mkdir()
    (tmp_path / "MAR-INF" / "MANIFEST.json").write_text(json.dumps({"model": {"modelName": "x"}}))
    (tmp_path / "model").mkdir()
    s = SimpleNamespace(tokenizer=SimpleNamespace(name_or_path=str(tmp_path / "model")),
                        limits=ModelLimits(1, 64, None))
    out = ModelsApi().prepare(None, "", s)
    assert isinstance(out, Immediate)
    assert [m["id"] for m in json.loads(out.body)["data"]] == ["x"]
    assert served_name(str(tmp_path.parent / "no-manifest" / "ckpt")) == "ckpt"


# --- framing ---

FINISH = FinishEvent("length", prompt_tokens=5, completion_tokens=3, text="Hello world")


def events(text: str) -> list[str]:
    assert text.endswith("\n\n")
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e]


def meta(chat: bool, include_usage: bool = False) -> ResponseMeta:
    return ResponseMeta("id-1", 123, "tiny", chat, include_usage)


def test_sse_chat_stream_role_first_finish_last_then_done() -> None:
    f = OpenAISseFramer(meta(chat=True))
    first, second = f.chunk("Hello"), f.chunk(" world")
    assert len(events(first)) == len(events(second)) == 1  # one event per wire chunk
    a, b = json.loads(events(first)[0]), json.loads(events(second)[0])
    assert a["object"] == "chat.completion.chunk" and a["id"] == "id-1" and "usage" not in a
    assert a["choices"][0]["delta"] == {"role": "assistant", "content": "Hello"}
    assert b["choices"][0] == {"index": 0, "delta": {"content": " world"}, "logprobs": None,
                               "finish_reason": None}
    assert f.chunk("") == ""
    end = events(f.final(FINISH))
    assert end[-1] == "[DONE]" and f.final(FINISH).endswith(DONE)
    assert json.loads(end[0])["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                                "finish_reason": "length"}


def test_sse_usage_chunk_before_done() -> None:
    f = OpenAISseFramer(meta(chat=True, include_usage=True))
    assert json.loads(events(f.chunk("Hi"))[0])["usage"] is None
    last, usage_event, done = events(f.final(FINISH))
    assert json.loads(last)["usage"] is None
    assert json.loads(usage_event)["choices"] == []
    assert json.loads(usage_event)["usage"] == {"prompt_tokens": 5, "completion_tokens": 3,
                                                "total_tokens": 8}
    assert done == "[DONE]"


def test_sse_chat_with_no_text_still_sends_the_role() -> None:
    first = json.loads(events(OpenAISseFramer(meta(chat=True)).final(FINISH))[0])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_sse_completion_chunks_carry_text() -> None:
    f = OpenAISseFramer(meta(chat=False))
    chunk = json.loads(events(f.chunk("Hi"))[0])
    assert chunk["object"] == "text_completion" and chunk["choices"][0]["text"] == "Hi"


def test_json_framers_give_whole_objects() -> None:
    chat = json.loads(OpenAIJsonFramer(meta(chat=True)).final(FINISH))
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "Hello world"}
    assert chat["usage"]["total_tokens"] == 8
    text = json.loads(OpenAIJsonFramer(meta(chat=False)).final(FINISH))
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "Hello world"
    assert text["choices"][0]["finish_reason"] == "length"


def test_errors_have_openai_shape_in_and_out_of_stream() -> None:
    body = json.loads(OpenAIErrorFramer().error(400, "bad", "max_tokens"))
    assert body == {"error": {"message": "bad", "type": "invalid_request_error",
                              "param": "max_tokens", "code": 400}}
    assert json.loads(OpenAIErrorFramer().error(503, "full"))["error"]["type"] == \
        "overloaded_error"
    assert json.loads(OpenAIErrorFramer().error(404, "no"))["error"]["type"] == \
        "invalid_request_error"
    streamed = OpenAISseFramer(meta(chat=True)).error(500, "boom", in_stream=True)
    err, done = events(streamed)
    assert json.loads(err)["error"]["message"] == "boom" and done == "[DONE]"


# --- probes, models, errors a client can act on ---

@pytest.mark.parametrize("path, body", [("health", ""), ("/ping", {"status": "Healthy"})])
def test_health_probes_answer_2xx_while_the_model_is_up(service, path, body) -> None:
    service.engine = SimpleNamespace(down=None)
    out = select_api(path).prepare(None, "", service)
    assert out.body == body or json.loads(out.body) == body


def test_health_is_503_while_the_engine_process_restarts(service) -> None:
    service.engine = SimpleNamespace(down="OSError: no device")
    err = rejects(select_api("health"), None, service, "", 503)
    assert "restarted" in err.message


def test_version_and_one_model_card(service) -> None:
    assert "version" in json.loads(select_api("version").prepare(None, "", service).body)
    card = json.loads(select_api("v1/models/model").prepare(None, "", service).body)
    assert card["id"] == "model" and card["object"] == "model"
    err = rejects(select_api("v1/models/gpt-4o"), None, service, "model", 404)
    assert "'model'" in err.message  # names the one that is served


def test_another_model_name_is_a_404_naming_the_served_one(service) -> None:
    err = rejects(CompletionsApi(), {"model": "gpt-4o", "prompt": "hi"}, service, "model", 404)
    assert "'gpt-4o'" in err.message and "'model'" in err.message


# --- extensions: honoured, or refused by name where the backend cannot ---

def test_extensions_reach_the_sampling_parameters(service) -> None:
    body = {"prompt": "hi there", "ignore_eos": True, "repetition_penalty": 1.2,
            "frequency_penalty": 0.5, "presence_penalty": -0.5, "min_tokens": 2,
            "logprobs": 3, "echo": True}
    s = CompletionsApi().prepare(body, "", service).request.sampling
    assert (s.ignore_eos, s.repetition_penalty, s.frequency_penalty, s.presence_penalty,
            s.min_new_tokens, s.logprobs, s.prompt_logprobs) == (True, 1.2, 0.5, -0.5, 2, 3, 3)
    plain = CompletionsApi().prepare({"prompt": "hi", "echo": True}, "", service)
    assert plain.request.sampling.prompt_logprobs is None  # echo alone needs no logits
    chat = ChatCompletionsApi().prepare({"messages": CHAT, "logprobs": True, "top_logprobs": 2},
                                        "", make_service(service.tokenizer,
                                                         chat_template="llama-2"))
    assert chat.request.sampling.logprobs == 2


SYNTH = {"backend": "synthetic", "synthetic": {"preset": "llama-2-7b-tp24"}}


@pytest.mark.parametrize("handler, body, param", [
    (SYNTH, {"repetition_penalty": 1.1}, "repetition_penalty"),
    (SYNTH, {"logprobs": 0}, "logprobs"),
    ({"backend": "neuron", "batching": "micro"}, {"ignore_eos": True}, "ignore_eos"),
    ({"backend": "neuron", "batching": "micro"}, {"min_tokens": 1}, "min_tokens"),
    ({"backend": "neuron"}, {"logprobs": 1, "echo": True}, "echo"),
    ({"backend": "nxdi", "neuron": {"on_device_sampling": True}}, {"presence_penalty": 1},
     "presence_penalty"),
])
def test_a_backend_that_cannot_honour_a_field_refuses_it_by_name(tokenizer, handler, body,
                                                                  param) -> None:
    service = make_service(tokenizer, **handler)
    err = rejects(CompletionsApi(), {"prompt": "hi", **body}, service, param)
    assert "handler." in err.message  # says which setting decides it


@pytest.mark.parametrize("handler, body", [
    ({"backend": "neuron"}, {"repetition_penalty": 1.1, "logprobs": 2, "ignore_eos": True}),
    ({"backend": "nxdi"}, {"frequency_penalty": 1.0, "logprobs": 1}),
    ({"backend": "nxdi", "neuron": {"on_device_sampling": True}}, {"ignore_eos": True}),
    (SYNTH, {"ignore_eos": True, "min_tokens": 1, "echo": True}),
])
def test_backends_that_sample_on_the_host_take_them(tokenizer, handler, body) -> None:
    CompletionsApi().prepare({"prompt": "hi", **body}, "", make_service(tokenizer, **handler))


def test_token_id_prompts_run_as_sent(service) -> None:
    for prompt in ([7, 8], [[7, 8]]):
        prepared = CompletionsApi().prepare({"prompt": prompt}, "", service)
        assert prepared.prompt_ids == [7, 8] and prepared.request.prompt.strip() == "hi there"


def test_stream_options_continuous_usage_needs_include_usage(service) -> None:
    body = {"prompt": "hi", "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    assert CompletionsApi().prepare(body, "", service).framer.counts_tokens
    body["stream_options"] = {"continuous_usage_stats": True}
    assert not CompletionsApi().prepare(body, "", service).framer.counts_tokens


# --- logprobs and usage on the wire ---

LP_FINISH = FinishEvent("length", 2, 2, "there hi", token_ids=(8, 7),
                        logprobs=((-0.5, ((8, -0.5), (7, -1.0))), (-0.25, ((7, -0.25),))),
                        prompt_logprobs=(None, (-2.0, ((8, -1.5),))))


def lp_meta(tokenizer, chat: bool, **kw) -> ResponseMeta:
    return ResponseMeta("id-1", 1, "tiny", chat, token_text=lambda t: tokenizer.decode([t]),
                        **kw)


def test_completion_logprobs_have_openais_shape_with_the_echoed_prompt(tokenizer) -> None:
    m = lp_meta(tokenizer, False, echo="hi there", echo_ids=(7, 8))
    choice = json.loads(OpenAIJsonFramer(m).final(LP_FINISH))["choices"][0]
    assert choice["text"] == "hi therethere hi"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["hi", "there", "there", "hi"]
    assert lp["token_logprobs"] == [None, -2.0, -0.5, -0.25]
    # the chosen token is listed among the alternatives (vLLM does the same)
    assert lp["top_logprobs"] == [None, {"there": -1.5}, {"there": -0.5, "hi": -1.0},
                                  {"hi": -0.25}]
    assert lp["text_offset"] == [0, 2, 7, 12]
    hidden = lp_meta(tokenizer, False, echo="hi there", echo_ids=(7, 8), hide_generated=True)
    out = json.loads(OpenAIJsonFramer(hidden).final(LP_FINISH))
    assert out["choices"][0]["text"] == "hi there"
    assert out["choices"][0]["logprobs"]["token_logprobs"] == [None, -2.0]
    assert out["usage"]["completion_tokens"] == 0


def test_chat_logprobs_have_openais_shape(tokenizer) -> None:
    choice = json.loads(OpenAIJsonFramer(lp_meta(tokenizer, True)).final(LP_FINISH))["choices"][0]
    first = choice["logprobs"]["content"][0]
    assert first == {"token": "there", "logprob": -0.5, "bytes": list(b"there"),
                     "top_logprobs": [{"token": "there", "logprob": -0.5, "bytes": list(b"there")},
                                      {"token": "hi", "logprob": -1.0, "bytes": list(b"hi")}]}
    assert len(choice["logprobs"]["content"]) == 2


def test_continuous_usage_is_on_every_chunk() -> None:
    framer = OpenAISseFramer(ResponseMeta("id", 1, "tiny", True, True, True), prompt_tokens=5)
    framer.tokens = 2
    first = json.loads(events(framer.chunk("Hi"))[0])
    assert first["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    last = [json.loads(e) for e in events(framer.final(FINISH))[:-1]]
    assert [e["usage"]["completion_tokens"] for e in last] == [3, 3]
    assert last[-1]["choices"] == []
