from pathlib import Path

import pytest

from handlers.config import load_config, parse_config
from handlers.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_tiny_config_loads_and_round_trips():
    cfg = load_config(ROOT / "model_configs" / "tiny-llama-cpu.yaml")
    assert cfg.handler.backend == "torch" and cfg.frontend.async_communication
    assert parse_config(cfg.to_yaml_dict()) == cfg


@pytest.mark.parametrize("data,message", [
    ({"handler": {"batch_sise": 4}}, "did you mean 'batch_size'"),
    ({"batchSise": 4}, "did you mean 'batchSize'"),
    ({"handler": {"batching": "dynamic"}}, "choose one of 'continuous', 'micro'"),
    ({"handler": {"batch_size": 0}}, "out of range"),
    ({"handler": {"batch_size": "4"}}, "expected int"),
    ({"handler": {"batching": "micro", "batch_size": 2, "micro_batch_size": 4}},
     "micro_batch_size: 4 exceeds"),
    ({"handler": {"max_length": 64, "max_new_tokens_limit": 64}}, "leaves no room"),
    ({"handler": {"defaults": {"max_new_tokens": 900}}}, "exceeds handler.max_new_tokens_limit"),
    ({"asyncCommunication": False}, "asyncCommunication: must be true"),
    ({"continuousBatching": True}, "continuousBatching: must be false"),
    ({"handler": {"neuron": {"tp_degre": 2}}}, "handler.neuron.tp_degre: unknown key"),
    ({"handler": {"defaults": {"top_p": 0}}}, "top_p 0.0 must be in"),
    ({"handler": {"defaults": {"temperature": 200}}}, "temperature 200.0 in"),
    ({"handler": {"neuron": {"context_length_estimate": [128, "a"]}}},
     r"handler.neuron.context_length_estimate\[1\]: expected int, got 'a'"),
    ({"handler": {"neuron": {"compiler_flags": ["-O1", 2]}}},
     r"handler.neuron.compiler_flags\[1\]: expected str, got 2"),
    ({"handler": {"nxdi": {"token_generation_buckets": [0]}}},
     r"handler.nxdi.token_generation_buckets\[0\]: 0 is out of range; allowed \[1, inf\]"),
    ({"handler": {"max_length": 512, "max_new_tokens_limit": 256,
                  "neuron": {"context_length_estimate": [1024]}}}, "not prefill lengths"),
    ({"handler": {"neuron": {"compilation_worker_count": -1}}},
     r"handler.neuron.compilation_worker_count: -1 is out of range; allowed \[0, 64\]"),
    ({"handler": {"neuron": {"compilation_worker_count": "all"}}}, "expected int"),
    ({"handler": {"request_timeout_s": 10, "max_request_timeout_s": 5}},
     r"handler.request_timeout_s: 10 must be in \(0, handler.max_request_timeout_s 5\]"),
    ({"handler": {"request_timeout_s": 0, "max_request_timeout_s": 5}}, "set it to 0"),
    ({"handler": {"request_timeout_s": -1}}, "out of range"),
    ({"clientTimeoutInMills": 60_000, "handler": {"request_timeout_s": 30}},
     r"max_request_timeout_s: 3600 must be in \(0, clientTimeoutInMills/1000 = 60\]"),
])
def test_errors_name_the_key_and_the_fix(data, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(data)


def test_top_level_must_be_a_mapping():
    with pytest.raises(ConfigError, match="got list"):
        parse_config([1, 2])


def test_yaml_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("handler: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_compilation_worker_count_defaults_to_one_graph_at_a_time():
    assert parse_config({}).handler.neuron.compilation_worker_count == 1
    every = parse_config({"handler": {"backend": "neuron",
                                      "neuron": {"compilation_worker_count": 0}}})
    assert every.handler.neuron.compilation_worker_count == 0  # the SDK's default: all at once


def test_deadline_defaults_and_no_cap():
    h = parse_config({}).handler
    assert (h.request_timeout_s, h.max_request_timeout_s) == (300.0, 3600.0)
    h = parse_config({"handler": {"request_timeout_s": 0, "max_request_timeout_s": 0}}).handler
    assert h.request_timeout_s == 0  # no deadline, no cap: an operator's explicit choice


def test_every_defaultable_request_field_has_a_default():
    """README's request table: every field but prompt, timeout and response_format (a
    request's own grammar) takes handler.defaults."""
    from handlers.api.request import FIELDS, parse_request

    d = {"max_new_tokens": 9, "min_new_tokens": 3, "temperature": 0.5, "top_k": 7,
         "top_p": 0.9, "stop": ["\n\n"], "seed": 11, "stream": False,
         "stream_format": "ndjson", "details": True}
    assert set(d) == set(FIELDS) - {"prompt", "timeout", "response_format"}
    h = parse_config({"handler": {"defaults": d}}).handler
    r = parse_request({"prompt": "hi"}, h)
    assert (r.max_new_tokens, r.min_new_tokens, r.stop, r.stream, r.stream_format,
            r.details) == (9, 3, ("\n\n",), False, "ndjson", True)
    s = r.sampling
    assert (s.temperature, s.top_k, s.top_p, s.seed) == (0.5, 7, 0.9, 11)
    # a request's own values win; a smaller max_new_tokens caps the default minimum
    r = parse_request({"prompt": "hi", "stop": [], "seed": 1, "max_new_tokens": 2}, h)
    assert (r.stop, r.sampling.seed, r.min_new_tokens) == ((), 1, 2)


@pytest.mark.parametrize("defaults, expected", [
    ({"min_new_tokens": 65}, "handler.defaults.min_new_tokens: 65 exceeds"),
    ({"stop": [""]}, "handler.defaults.stop"),
    ({"stop": ["x"] * 9}, "handler.defaults.stop"),
    ({"stop": "x"}, "handler.defaults.stop: expected list"),
    ({"seed": -1}, "handler.defaults.seed: -1 is out of range"),
    ({"details": "yes"}, "handler.defaults.details: expected bool"),
])
def test_request_defaults_are_validated(defaults, expected):
    with pytest.raises(ConfigError, match=expected):
        parse_config({"handler": {"defaults": defaults}})


@pytest.mark.parametrize("setting, preset", [("llama2", "llama-2"), ("Llama-2", "llama-2"),
                                             ("llama_2", "llama-2"), ("qwen-3", "qwen3"),
                                             ("Mistral", "mistral")])
def test_chat_template_typo_names_the_preset(setting, preset):
    with pytest.raises(ConfigError, match=f"handler.chat_template: .*did you mean '{preset}'"):
        parse_config({"handler": {"chat_template": setting}})


@pytest.mark.parametrize("setting", ["llama-2", "qwen2.5", "qwen3", "mistral", "chat.jinja",
                                     "templates/chat", "{{ x }}", ""])
def test_chat_template_presets_files_and_jinja_pass(setting):
    assert parse_config({"handler": {"chat_template": setting}}).handler.chat_template == setting


@pytest.mark.parametrize("value, message", [
    (-1, r"handler.synthetic.host_sampling_vocab: -1 is out of range; allowed \[0, 1000000\]"),
    (1_000_001, "host_sampling_vocab: 1000001 is out of range"),
    ("128256", "host_sampling_vocab: expected int"),
    (True, "host_sampling_vocab: expected int"),
    (1.5, "host_sampling_vocab: expected int"),
])
def test_synthetic_host_sampling_vocab_is_checked(value, message):
    synthetic = {"decode_step_ms": 10, "host_sampling_vocab": value}
    with pytest.raises(ConfigError, match=message):
        parse_config({"handler": {"backend": "synthetic", "synthetic": synthetic}})


def test_synthetic_host_sampling_vocab_defaults_off_and_round_trips():
    cfg = parse_config({"handler": {"backend": "synthetic", "synthetic": {"decode_step_ms": 10}}})
    assert cfg.handler.synthetic.host_sampling_vocab == 0
    on = parse_config({"handler": {"backend": "synthetic", "synthetic": {
        "decode_step_ms": 10, "host_sampling_vocab": 128256}}})
    assert on.handler.synthetic.host_sampling_vocab == 128256
    assert parse_config(on.to_yaml_dict()) == on
    with pytest.raises(ConfigError, match="host_sampling_vocabulary: unknown key; did you mean "
                                          "'host_sampling_vocab'"):
        parse_config({"handler": {"backend": "synthetic", "synthetic": {
            "decode_step_ms": 10, "host_sampling_vocabulary": 128256}}})


def test_nested_typed_blocks_are_checked_element_by_element() -> None:
    """Lists of ints, mappings and nested settings blocks, with the same did-you-mean and
    the element's path: what quantization and speculation blocks will need."""
    import dataclasses

    from handlers.config import _build, _opt

    @dataclasses.dataclass(frozen=True)
    class Draft:
        checkpoint: str = _opt("draft")
        speculation_length: int = _opt(4, lo=1, hi=8)

    @dataclasses.dataclass(frozen=True)
    class Block:
        layers: list[int] = _opt([], lo=0)
        scales: dict[str, float] = _opt({})
        drafts: list[Draft] = _opt([])
        draft: Draft | None = _opt(None)

    b = _build(Block, {"layers": [0, 3], "scales": {"q": 1, "k": 0.5},
                       "drafts": [{"speculation_length": 2}], "draft": None}, "x")
    assert b == Block([0, 3], {"q": 1.0, "k": 0.5}, [Draft("draft", 2)], None)
    for data, message in [
        ({"layers": [0, -1]}, r"x.layers\[1\]: -1 is out of range"),
        ({"scales": {"q": "big"}}, r"x.scales.q: expected float, got 'big'"),
        ({"scales": {1: 1.0}}, r"x.scales key 1: expected str"),
        ({"drafts": [{"speculation_lenght": 2}]},
         r"x.drafts\[0\].speculation_lenght: unknown key; did you mean 'speculation_length'"),
        ({"draft": {"speculation_length": 9}}, r"x.draft.speculation_length: 9 is out of range"),
        ({"draft": [1]}, r"x.draft: expected a mapping"),
    ]:
        with pytest.raises(ConfigError, match=message):
            _build(Block, data, "x")


@pytest.mark.parametrize("backend,torch_dtype,amp", [
    ("torch", "float32", "f32"), ("synthetic", "float32", "f32"),
    ("neuron", "bfloat16", "bf16"), ("nxdi", "bfloat16", "bf16"),
])
def test_dtype_auto_is_each_backends_own_default(backend, torch_dtype, amp):
    extra = {"synthetic": {"decode_step_ms": 10}} if backend == "synthetic" else {}
    h = parse_config({"handler": {"backend": backend, **extra}}).handler
    assert h.dtype == "auto"
    assert (h.torch_dtype, h.amp) == (torch_dtype, amp)
    h = parse_config({"handler": {"backend": backend, "dtype": "float16", **extra}}).handler
    assert (h.torch_dtype, h.amp) == ("float16", "f16")


@pytest.mark.parametrize("amp,dtype", [("bf16", "bfloat16"), ("f16", "float16"),
                                       ("f32", "float32")])
def test_legacy_neuron_amp_sets_dtype_with_a_deprecation_warning(amp, dtype):
    legacy = {"backend": "neuron", "neuron": {"tp_degree": 4, "amp": amp}}
    with pytest.warns(DeprecationWarning, match="handler.neuron.amp is deprecated; use "
                                                f"handler.dtype: {dtype}"):
        old = parse_config({"handler": legacy})
    assert (old.handler.dtype, old.handler.torch_dtype, old.handler.amp) == (dtype, dtype, amp)
    new = parse_config({"handler": {"backend": "neuron", "dtype": dtype,
                                    "neuron": {"tp_degree": 4}}})
    assert old == new and legacy["neuron"]["amp"] == amp  # the caller's mapping is untouched
    with pytest.warns(DeprecationWarning):  # the same precision twice is redundant, not wrong
        both = parse_config({"handler": {**legacy, "dtype": dtype}})
    assert both == new


def test_legacy_neuron_amp_conflicting_with_dtype_is_refused():
    with pytest.raises(ConfigError, match=r"handler.neuron.amp: 'f16' conflicts with "
                                          r"handler.dtype 'bfloat16'; precision is one key now, "
                                          r"handler.dtype"):
        parse_config({"handler": {"backend": "neuron", "dtype": "bfloat16",
                                  "neuron": {"amp": "f16"}}})


@pytest.mark.parametrize("amp", ["fp16", "bfloat16", 16, None])
def test_legacy_neuron_amp_bad_value_names_the_key_and_choices(amp):
    with pytest.raises(ConfigError, match=r"handler.neuron.amp: .* is not allowed; choose one of "
                                          r"'bf16', 'f16', 'f32'"):
        parse_config({"handler": {"backend": "neuron", "neuron": {"amp": amp}}})


def test_dtype_is_checked_even_beside_a_legacy_amp():
    with pytest.raises(ConfigError, match=r"handler.dtype: 'float64' is not allowed; choose one "
                                          r"of 'auto', 'float32', 'bfloat16', 'float16'"), \
            pytest.warns(DeprecationWarning):
        parse_config({"handler": {"dtype": "float64", "neuron": {"amp": "bf16"}}})


def test_legacy_neuron_amp_never_changes_a_torch_backend():
    """It never applied to torch: an old torch config that carried it runs as it did."""
    with pytest.warns(DeprecationWarning):
        h = parse_config({"handler": {"neuron": {"amp": "bf16"}}}).handler
    assert (h.dtype, h.torch_dtype) == ("auto", "float32")
    with pytest.warns(DeprecationWarning):
        h = parse_config({"handler": {"dtype": "float32", "neuron": {"amp": "f16"}}}).handler
    assert h.torch_dtype == "float32"


@pytest.mark.parametrize("backend", ["neuron", "nxdi"])
def test_speculation_needs_on_device_sampling_and_room_in_max_length(backend):
    spec = {"draft_checkpoint": "draft", "length": 4}
    with pytest.raises(ConfigError, match=r"handler.neuron.speculation: needs handler.neuron."
                                          r"on_device_sampling: true"):
        parse_config({"handler": {"backend": backend, "neuron": {"speculation": spec}}})
    with pytest.raises(ConfigError, match=r"speculation.length: 4 leaves no room"):
        parse_config({"handler": {"backend": backend, "max_length": 5, "max_new_tokens_limit": 2,
                                  "defaults": {"max_new_tokens": 2},
                                  "neuron": {"on_device_sampling": True, "speculation": spec}}})
    h = parse_config({"handler": {"backend": backend, "neuron": {
        "on_device_sampling": True, "speculation": spec}}}).handler
    assert h.neuron.speculation.enabled and h.neuron.speculation.length == 4
    assert not parse_config({"handler": {"backend": backend}}).handler.neuron.speculation.enabled


def test_legacy_nxdi_sampling_keys_load_as_the_neuron_ones_with_a_deprecation_warning():
    legacy = {"backend": "nxdi", "nxdi": {"on_device_sampling": True, "global_topk": 64}}
    with pytest.warns(DeprecationWarning) as record:
        old = parse_config({"handler": legacy}).handler
    assert sorted(str(w.message).split(";")[0] for w in record) == [
        "handler.nxdi.global_topk is deprecated", "handler.nxdi.on_device_sampling is deprecated"]
    new = parse_config({"handler": {"backend": "nxdi", "neuron": {
        "on_device_sampling": True, "global_top_k": 64}}}).handler
    assert old == new and (old.neuron.on_device_sampling, old.neuron.global_top_k) == (True, 64)
    assert legacy["nxdi"] == {"on_device_sampling": True, "global_topk": 64}  # untouched
    with pytest.warns(DeprecationWarning):  # the same value in both places is redundant only
        both = parse_config({"handler": {**legacy, "neuron": {"global_top_k": 64}}}).handler
    assert both == new


def test_legacy_nxdi_sampling_key_conflicting_with_the_neuron_one_is_refused():
    with pytest.raises(ConfigError, match=r"handler.nxdi.on_device_sampling: True conflicts with "
                                          r"handler.neuron.on_device_sampling False"):
        parse_config({"handler": {"backend": "nxdi", "nxdi": {"on_device_sampling": True},
                                  "neuron": {"on_device_sampling": False}}})


def test_speculation_keeps_length_positions_free_of_the_token_limit():
    spec = {"on_device_sampling": True, "speculation": {"draft_checkpoint": "draft", "length": 4}}
    with pytest.raises(ConfigError, match=r"handler.max_new_tokens_limit: 60 leaves no room for "
                                          r"a prompt in the 60 positions"):
        parse_config({"handler": {"backend": "neuron", "max_length": 64,
                                  "max_new_tokens_limit": 60, "defaults": {"max_new_tokens": 8},
                                  "neuron": spec}})
    assert parse_config({"handler": {"backend": "neuron", "max_length": 64,
                                     "max_new_tokens_limit": 59,
                                     "defaults": {"max_new_tokens": 8}, "neuron": spec}})


@pytest.mark.parametrize("backend", ["torch", "synthetic"])
@pytest.mark.parametrize("handler, named", [
    ({"neuron": {"quantization": {"weights": "int8"}}}, "handler.neuron.quantization.weights"),
    ({"neuron": {"speculation": {"draft_checkpoint": "draft", "length": 5}}},
     "handler.neuron.speculation.draft_checkpoint, handler.neuron.speculation.length"),
    ({"neuron": {"tp_degree": 8}}, "handler.neuron.tp_degree"),
    ({"nxdi": {"fused_qkv": True}}, "handler.nxdi.fused_qkv"),
])
def test_neuron_only_settings_on_another_backend_are_refused_by_name(backend: str, handler: dict,
                                                                     named: str) -> None:
    extra = {"synthetic": {"decode_step_ms": 1}} if backend == "synthetic" else {}
    with pytest.raises(ConfigError) as info:
        parse_config({"handler": {"backend": backend, **extra, **handler}})
    section = named.split(".")[1]
    assert str(info.value).startswith(f"{named}: set, but handler.backend is {backend!r}, which "
                                      f"never reads handler.{section}")
    assert "remove it, or set handler.backend: " in str(info.value)


def test_neuron_defaults_written_out_whole_still_load_on_torch() -> None:
    """ModelConfig.to_yaml_dict writes every key, the neuron ones at their defaults."""
    cfg = parse_config({"handler": {"backend": "torch"}})
    assert parse_config(cfg.to_yaml_dict()) == cfg
