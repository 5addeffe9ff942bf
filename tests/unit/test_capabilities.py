"""What a backend honours, declared once and checked in one place for both APIs."""

import pickle

import pytest

from handlers.backends import capabilities_for
from handlers.backends.base import Capabilities, SamplingParams
from handlers.backends.capabilities import asked, check_sampling, sampling_group
from handlers.config import parse_config
from handlers.errors import RequestError


def handler(**kw):
    return parse_config({"handler": kw}).handler


def test_asked_lists_only_features_that_change_the_answer():
    assert asked(SamplingParams()) == []
    assert asked(SamplingParams(seed=3)) == []  # greedy: a seed changes nothing
    assert asked(SamplingParams(temperature=1.0, seed=3, min_new_tokens=2, logprobs=0)) == [
        "seed", "min_new_tokens", "logprobs"]


def test_refusals_name_the_field_as_the_api_calls_it_and_the_setting():
    caps = Capabilities.lacking(("min_new_tokens",), "handler.x decides; use y")
    with pytest.raises(RequestError) as err:
        check_sampling(SamplingParams(min_new_tokens=1), caps, {"min_new_tokens": "min_tokens"})
    assert (err.value.field, err.value.status) == ("min_tokens", 400)
    assert "handler.x decides; use y" in err.value.message
    bounded = Capabilities(max_top_k=8, max_top_k_setting="handler.neuron.global_top_k")
    check_sampling(SamplingParams(top_k=9), bounded)  # greedy ignores top_k
    with pytest.raises(RequestError, match=r"allowed \[0, 8\] \(handler.neuron.global_top_k"):
        check_sampling(SamplingParams(temperature=1.0, top_k=9), bounded)


def test_capabilities_cross_the_engine_process_pipe_and_refuse_unknown_features():
    caps = Capabilities.lacking(("seed", "logprobs"), "why", shared_sampling=True)
    assert pickle.loads(pickle.dumps(caps)) == caps
    with pytest.raises(ValueError, match="unknown capability features"):
        Capabilities({"sed": "typo"})


def test_sampling_groups():
    assert sampling_group(SamplingParams(top_k=3, seed=1)) == sampling_group(SamplingParams())
    assert sampling_group(SamplingParams(temperature=1.0, seed=1)) is None
    hot = SamplingParams(temperature=1.0, top_p=0.9)
    assert sampling_group(hot) == sampling_group(SamplingParams(temperature=1.0, top_p=0.9))
    assert sampling_group(hot) != sampling_group(SamplingParams(temperature=0.9, top_p=0.9))


@pytest.mark.parametrize("cfg, refused, honoured", [
    ({"backend": "torch"}, [], ["seed", "min_new_tokens", "logprobs", "prompt_logprobs"]),
    ({"backend": "neuron", "batching": "continuous"}, ["prompt_logprobs"],
     ["seed", "min_new_tokens", "logprobs", "repetition_penalty"]),
    ({"backend": "neuron", "batching": "micro"},
     ["min_new_tokens", "ignore_eos", "logprobs", "repetition_penalty"], ["seed"]),
    ({"backend": "nxdi", "batching": "continuous"}, ["prompt_logprobs"], ["seed", "logprobs"]),
    ({"backend": "nxdi", "batching": "continuous", "neuron": {"on_device_sampling": True}},
     ["seed", "min_new_tokens", "logprobs"], ["ignore_eos"]),
    ({"backend": "synthetic", "synthetic": {"preset": "llama-2-7b-tp24"}},
     ["logprobs", "repetition_penalty"], ["seed", "min_new_tokens", "ignore_eos"]),
])
def test_each_backend_declares_what_it_honours(cfg, refused, honoured):
    caps = capabilities_for(handler(**cfg))
    assert [f for f in refused if f in caps.unsupported] == refused
    assert [f for f in honoured if f in caps.unsupported] == []
    assert all("handler." in why for why in caps.unsupported.values())  # names the setting
    assert caps.shared_sampling == (cfg.get("batching") == "micro")


def test_a_default_the_backend_cannot_honour_is_a_config_error_at_validate(tmp_path, capsys):
    """Every request leaving the field out would be refused: say so before packaging."""
    from archive_tools.cli import main
    from handlers.backends.capabilities import check_defaults
    from handlers.errors import ConfigError

    micro = handler(backend="neuron", batching="micro", defaults={"min_new_tokens": 1})
    with pytest.raises(ConfigError, match=r"handler.defaults.min_new_tokens: .*batching micro"):
        check_defaults(micro, capabilities_for(micro))
    check_defaults(handler(backend="neuron", defaults={"min_new_tokens": 1}),
                   capabilities_for(handler(backend="neuron")))  # continuous honours it
    path = tmp_path / "model-config.yaml"
    path.write_text("handler:\n  backend: nxdi\n  batching: continuous\n  neuron:\n"
                    "    on_device_sampling: true\n  defaults:\n    temperature: 0.7\n"
                    "    seed: 3\n")
    assert main(["validate", str(path)]) != 0
    out = capsys.readouterr()
    assert "handler.defaults.seed" in out.out + out.err and "Traceback" not in out.err
