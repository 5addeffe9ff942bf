"""Family x backend x feature: what the SDKs refuse, `validate` and `package` refuse in one
line naming the reason; what they accept loads in the fakes (which enforce the same rules,
tests/fakes) and decodes.

Each row is a tiny checkpoint of the family (built with transformers, with the row's
config.json changes) and the row's handler settings. The reasons cite the SDK source in
handlers/backends/neuron_families.py and nxdi_families.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from archive_tools.cli import main
from handlers.backends.base import SamplingParams
from handlers.config import parse_config
from tests.family_checkpoints import build_family_checkpoint, has_family
from tests.unit.fakes import one_each

SPEC = {"on_device_sampling": True, "speculation": {"draft_checkpoint": "draft", "length": 2}}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
LINEAR = {"rope_type": "linear", "factor": 2.0}

# (id, family, backend, config.json changes, handler.neuron, handler.nxdi, refusal or None)
ROWS = [
    ("neuron-qwen2", "qwen2", "neuron", {}, {}, {}, r"no Qwen2 model .*use handler.backend: nxdi"),
    ("neuron-qwen3", "qwen3", "neuron", {}, {}, {}, r"no Qwen3 model .*backend: nxdi"),
    ("neuron-mistral-int8-fp8kv-ods", "mistral", "neuron", {},
     {"quantization": {"weights": "int8", "kv_cache": "fp8"}, "on_device_sampling": True}, {},
     None),
    ("neuron-mistral-speculation", "mistral", "neuron", {}, SPEC, {},
     r"k \+ 1 a speculative step verifies \(mistral/hlo.py:L131-L133\)"),
    ("neuron-mistral-skip-modules", "mistral", "neuron", {},
     {"quantization": {"weights": "fp8", "skip_modules": ["model.layers.0"]}}, {},
     r"skip_modules: transformers-neuronx's Mistral reads no no_quantize_list"),
    ("neuron-mistral-window-in-prefill", "mistral", "neuron", {"sliding_window": 12},
     {"context_length_estimate": [8, 64]}, {}, r"prefill bucket of 64 exceeds .*sliding_window 12"),
    ("neuron-mistral-rope-scaling", "mistral", "neuron", {"rope_scaling": LINEAR}, {}, {},
     r"rope_scaling .*reads no rope_scaling"),
    ("neuron-mixtral-tp4-int8", "mixtral", "neuron", {},
     {"tp_degree": 4, "quantization": {"weights": "int8"}}, {}, None),
    ("neuron-mixtral-int8-experts-per-core", "mixtral", "neuron", {},
     {"quantization": {"weights": "int8"}}, {}, r"2 experts per NeuronCore .*mixtral/hlo.py"),
    ("neuron-mixtral-experts-vs-tp", "mixtral", "neuron", {"num_local_experts": 6},
     {"tp_degree": 4}, {}, r"tp_degree: 4 with 6 experts; .*use one of \[1, 2, 24\]"),
    ("neuron-mixtral-speculation", "mixtral", "neuron", {}, SPEC, {},
     r"mistral/hlo.py:L131-L133"),
    ("nxdi-qwen2-int8-fp8kv-ods-fused-qkv", "qwen2", "nxdi", {},
     {"quantization": {"weights": "int8", "kv_cache": "fp8"}, "on_device_sampling": True},
     {"fused_qkv": True}, None),
    ("nxdi-qwen2-yarn", "qwen2", "nxdi", {"rope_scaling": YARN}, {}, {},
     r"rope_scaling .*reads rope_theta only"),
    ("nxdi-qwen2-sliding-window", "qwen2", "nxdi",
     {"use_sliding_window": True, "sliding_window": 32}, {}, {},
     r"sliding_window 32 within handler.max_length 128; .*qwen2 class ignores it"),
    ("nxdi-qwen3-int8-async", "qwen3", "nxdi", {},
     {"quantization": {"weights": "int8"}, "on_device_sampling": True}, {"async_mode": True},
     None),
    ("nxdi-qwen3-fused-qkv", "qwen3", "nxdi", {}, {}, {"fused_qkv": True},
     r"Qwen3 does not fuse q/k/v weights"),
    ("nxdi-qwen3-attention-bias", "qwen3", "nxdi", {"attention_bias": True}, {}, {},
     r"attention_bias true; .*would drop it"),
    ("nxdi-mistral-window-speculation", "mistral", "nxdi", {"sliding_window": 64}, SPEC, {},
     r"sliding_window 64 with fused speculation .*attention_base.py:L321-L322"),
    ("nxdi-mistral-fp8kv-ods", "mistral", "nxdi", {"sliding_window": 64},
     {"quantization": {"kv_cache": "fp8"}, "on_device_sampling": True}, {}, None),
    ("nxdi-mixtral-ods", "mixtral", "nxdi", {}, {"on_device_sampling": True}, {}, None),
    ("nxdi-mixtral-tp-vs-intermediate", "mixtral", "nxdi", {"intermediate_size": 102},
     {"tp_degree": 4}, {}, r"tp_degree: 4 does not divide .*intermediate_size 102"),
    ("nxdi-mixtral-int8", "mixtral", "nxdi", {}, {"quantization": {"weights": "int8"}}, {},
     r"Mixtral fuses the experts' weights but not their quantization scales"),
    ("nxdi-mixtral-window", "mixtral", "nxdi", {"sliding_window": 32}, {}, {},
     r"sliding_window 32 within handler.max_length 128; .*mixtral class ignores it"),
]


def _yaml(tmp_path: Path, backend: str, neuron: dict, nxdi: dict) -> Path:
    handler = {"backend": backend, "batch_size": 2, "max_length": 128, "dtype": "float32",
               "max_new_tokens_limit": 64, "defaults": {"max_new_tokens": 16},
               "neuron": {"tp_degree": 2, "cores_per_instance": 4,
                          "cache_dir": str(tmp_path / "cache"),
                          "core_lock_dir": str(tmp_path / "locks"), **neuron}}
    if backend == "nxdi":
        handler["nxdi"] = nxdi
    path = tmp_path / "model-config.yaml"
    path.write_text(yaml.safe_dump({"asyncCommunication": True, "handler": handler}))
    return path


def _checkpoints(tmp_path: Path, family: str, changes: dict, tokenizer: Path,
                 speculation: bool) -> Path:
    if not has_family(family):
        pytest.skip(f"this transformers has no {family} (NxD Inference 0.8 pins 4.57)")
    ckpt = build_family_checkpoint(tmp_path / "ckpt", family, tokenizer, **changes)
    if speculation:  # a one-layer draft of the same family, inside the model dir
        build_family_checkpoint(tmp_path / "draft", family, tokenizer, seed=1,
                                num_hidden_layers=1, **changes)
    return ckpt


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_each_combination_is_refused_with_its_reason_or_loads(row, tmp_path, tiny_checkpoint,
                                                               capsys, request) -> None:
    _, family, backend, changes, neuron, nxdi, refusal = row
    speculation = "speculation" in neuron
    ckpt = _checkpoints(tmp_path, family, changes, tiny_checkpoint, speculation)
    config = _yaml(tmp_path, backend, neuron, nxdi)
    draft = ["--draft-checkpoint", str(tmp_path / "draft")] if speculation else []
    if refusal is not None:
        for argv in (["validate", str(config), "--checkpoint", str(ckpt)],
                     ["package", "--config", str(config), "--checkpoint", str(ckpt), *draft,
                      "--name", "m", "--out", str(tmp_path / "store"), "--format",
                      "no-archive"]):
            code = main(argv)
            out, err = capsys.readouterr()
            lines = [x for x in (out + err).splitlines() if x.startswith("error:")]
            assert code != 0 and len(lines) == 1, (argv[0], out, err)
            assert __import__("re").search(refusal, lines[0]), (argv[0], lines[0])
        assert not (tmp_path / "store").exists()
        return
    assert main(["validate", str(config), "--checkpoint", str(ckpt)]) == 0, capsys.readouterr()
    request.getfixturevalue("fake_sdk" if backend == "neuron" else "fake_nxdi")
    handler = parse_config(yaml.safe_load(config.read_text())).handler
    if backend == "neuron":
        from handlers.backends.neuron_backend import NeuronBackend as Backend
    else:
        from handlers.backends.nxdi_backend import NxdiBackend as Backend
    b = Backend(ckpt, handler, tmp_path)
    try:
        out = b.prefill([0], [[1, 50, 60, 70]], [SamplingParams()])
        out += one_each(b.decode([0]))
        b.release([0])
    finally:
        b.close()
    assert len(out) == 2


@pytest.mark.parametrize("backend", ["neuron", "nxdi"])
def test_a_named_architecture_is_checked_without_a_checkpoint(backend, tmp_path, capsys) -> None:
    """validate reads handler.neuron.architecture's config.json fields as a checkpoint's."""
    config = _yaml(tmp_path, backend, {"architecture": "llama-2-7b"}, {})
    assert main(["validate", str(config)]) == 0
    out = capsys.readouterr().out
    cls = "LlamaForSampling" if backend == "neuron" else "NeuronLlamaForCausalLM"
    assert "note: family llama: " in out and cls in out


@pytest.mark.parametrize("backend,draft_vocab,ok", [("nxdi", 1000, True), ("nxdi", 1100, False),
                                                    ("neuron", 1000, False)])
def test_a_draft_vocabulary_padded_less_is_taken_on_nxdi_only(backend, draft_vocab, ok, tmp_path,
                                                              tiny_checkpoint, capsys) -> None:
    """transformers-neuronx asserts equal vocabulary sizes (fused_speculation.py:L308-L310);
    NxD Inference has no such assert, so Qwen2.5-0.5B (151,936) drafts for Qwen2.5-7B
    (152,064): a draft may know fewer ids than the model, never more."""
    family = "qwen2" if backend == "nxdi" else "llama"
    ckpt = build_family_checkpoint(tmp_path / "ckpt", family, tiny_checkpoint)
    build_family_checkpoint(tmp_path / "draft", family, tiny_checkpoint, seed=1,
                            num_hidden_layers=1, vocab=draft_vocab)
    config = _yaml(tmp_path, backend, SPEC, {})
    code = main(["package", "--config", str(config), "--checkpoint", str(ckpt),
                 "--draft-checkpoint", str(tmp_path / "draft"), "--name", "m", "--out",
                 str(tmp_path / "store"), "--format", "no-archive", "--dry-run"])
    err = capsys.readouterr().err
    assert (code == 0) is ok, err
    if not ok:
        assert f"vocab_size {draft_vocab} differs from the model's 1024" in err
