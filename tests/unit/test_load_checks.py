"""Fail before the compile: `package` and the worker's start refuse the same inputs.

One table of damaged and accepted inputs, each run through `inf2serve package` (the CLI:
one line, no traceback) and through a worker's start (GenerationHandler.initialize on the
archive, the model loaded inline): what one refuses the other refuses, what packaging
accepts the worker loads. Then one test per case for `validate --checkpoint`, `compile`,
the archive's YAML and the chat endpoint.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from archive_tools import load_checks
from archive_tools.cli import main
from handlers.api.chat_template import NO_TEMPLATE_FIX, render_chat
from handlers.checkpoint_checks import INDEX, load_worker_config
from handlers.config import parse_config
from handlers.errors import ConfigError, RequestError
from handlers.generation_defaults import apply_generation_defaults, checkpoint_sampling
from handlers.torchserve.generation_handler import GenerationHandler

CONFIG = Path(__file__).resolve().parents[2] / "model_configs" / "tiny-llama-cpu.yaml"
FAST = {"engine_process": "inline", "warmup": False}  # the worker's start, in this process


# --- inputs ---

def write_config(path: Path, handler: dict | None = None, frontend: dict | None = None,
                 drop: tuple[str, ...] = (), append: str = "") -> Path:
    data = yaml.safe_load(CONFIG.read_text())
    data.update(frontend or {})
    data["handler"].update({**FAST, **(handler or {})})
    for key in drop:
        data.pop(key)
    path.write_text(yaml.safe_dump(data, sort_keys=False) + append)
    return path


def weights(ckpt: Path) -> Path:
    return ckpt / "model.safetensors"


def bad_length(ckpt: Path) -> None:
    data = weights(ckpt).read_bytes()
    weights(ckpt).write_bytes(struct.pack("<Q", len(data) * 2) + data[8:])


def bad_json(ckpt: Path) -> None:
    data = bytearray(weights(ckpt).read_bytes())
    data[8] = ord("#")  # the header's opening brace
    weights(ckpt).write_bytes(bytes(data))


def cut_short(ckpt: Path) -> None:
    data = weights(ckpt).read_bytes()
    weights(ckpt).write_bytes(data[:-64])


def shard(ckpt: Path) -> None:
    """Two shards and an index, as hub checkpoints ship large models."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights(ckpt))
    weights(ckpt).unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[:len(names) // 2], names[len(names) // 2:]), 1):
        name = f"model-0000{i}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(ckpt / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (ckpt / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def shard_missing(ckpt: Path) -> None:
    shard(ckpt)
    (ckpt / "model-00002-of-00002.safetensors").unlink()


def index_promises_more(ckpt: Path) -> None:
    shard(ckpt)
    index = json.loads((ckpt / INDEX).read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = "model-00001-of-00002.safetensors"
    (ckpt / INDEX).write_text(json.dumps(index))


def int8_tensor(ckpt: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights(ckpt))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int8)
    save_file(tensors, str(weights(ckpt)), metadata={"format": "pt"})


def garble(name: str) -> Callable[[Path], None]:
    return lambda ckpt: (ckpt / name).write_text('{"model_type": "llama",')


def no_chat_template(ckpt: Path) -> None:
    path = ckpt / "tokenizer_config.json"
    data = json.loads(path.read_text())
    data.pop("chat_template")
    path.write_text(json.dumps(data))


def sampling(ckpt: Path) -> None:
    (ckpt / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.7,
         "top_p": 0.9, "top_k": 40}))


def no_tokenizer(ckpt: Path) -> None:
    (ckpt / "tokenizer.json").unlink()


def edit_json(name: str, **changes) -> Callable[[Path], None]:
    """Set keys of a checkpoint JSON file (a callable of the key's old value: computed)."""
    def damage(ckpt: Path) -> None:
        data = json.loads((ckpt / name).read_text())
        data.update({k: v(data[k]) if callable(v) else v for k, v in changes.items()})
        (ckpt / name).write_text(json.dumps(data))
    return damage


def rope_only_in_rope_parameters(ckpt: Path) -> None:
    """config.json as transformers 5 writes it: RoPE under rope_parameters alone."""
    data = json.loads((ckpt / "config.json").read_text())
    data.pop("rope_theta", None)
    data.pop("rope_scaling", None)
    data["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    (ckpt / "config.json").write_text(json.dumps(data))


NEURON = {"backend": "neuron"}
BROKEN_TEMPLATE = "{% for m in messages %}{{ m['content'] }"


@dataclass(frozen=True)
class Case:
    id: str
    refused: str | None  # in both messages; None: both accept
    damage: Callable[[Path], None] = lambda ckpt: None
    handler: dict = field(default_factory=dict)
    drop: tuple[str, ...] = ()
    worker_refused: str | None = None  # the worker's message, where it is not `refused`
    append: str = ""  # text added at the end of model-config.yaml
    warns: str | None = None  # accepted with this warning, by both


CASES = [
    Case("header length prefix", "damaged safetensors header (length prefix", bad_length),
    Case("header not JSON", "damaged safetensors header (not JSON", bad_json),
    Case("file cut short", "file cut short", cut_short),
    Case("shard missing", f"listed in {INDEX} but missing", shard_missing),
    Case("index promises a tensor", f"which {INDEX} maps to it", index_promises_more),
    Case("int8 tensor, no quantization_config", "is I8, and config.json has no "
         "quantization_config", int8_tensor),
    Case("config.json not JSON", "config.json: not valid JSON", garble("config.json")),
    Case("generation_config.json not JSON", "generation_config.json: not valid JSON",
         garble("generation_config.json")),
    Case("max_length over positions", "exceeds the checkpoint's max_position_embeddings 2048",
         handler={"max_length": 4096}),
    Case("prefill bucket over max_length", "handler.neuron.context_length_estimate: [4096]",
         handler={"backend": "neuron", "neuron": {"context_length_estimate": [4096]}}),
    Case("no tokenizer", "no tokenizer files", no_tokenizer, worker_refused="tokenizer"),
    # 2: files a Neuron SDK's transformers 4.x cannot load (or reads wrongly)
    Case("transformers 5 tokenizer class, neuron", "tokenizer_class 'TokenizersBackend' "
         "(transformers 5's) does not exist in transformers 4.x",
         edit_json("tokenizer_config.json", tokenizer_class="TokenizersBackend"), NEURON),
    Case("extra_special_tokens list, neuron", "extra_special_tokens is a list (transformers "
         "5's form); transformers 4.48+ read a mapping there",
         edit_json("tokenizer_config.json", extra_special_tokens=["<tool>"]), NEURON),
    Case("RoPE only in rope_parameters, neuron", "RoPE is only under rope_parameters "
         "(rope_theta 500000.0, rope_type 'default')", rope_only_in_rope_parameters, NEURON),
    # 3: a chat template that does not compile
    Case("chat template syntax error", "chat_template: the chat template does not compile: "
         "unexpected '}' (template line 1)",
         edit_json("tokenizer_config.json", chat_template=BROKEN_TEMPLATE)),
    # 4: config.json that does not describe the weights
    Case("hidden_size doubled", "tensor 'model.embed_tokens.weight' is [1024, 64], but",
         edit_json("config.json", hidden_size=lambda h: h * 2)),
    Case("vocab_size halved", "implies [512, 64] (vocab_size x hidden_size",
         edit_json("config.json", vocab_size=lambda v: v // 2)),
    # 5: a key given twice
    Case("a key given twice", "minWorkers is given twice, at line 1 and line ",
         append="minWorkers: 1\n"),
    # 6: a Neuron-only setting on torch
    Case("neuron quantization on torch", "handler.neuron.quantization.weights: set, but "
         "handler.backend is 'torch'", handler={"neuron": {"quantization": {"weights": "int8"}}}),
    Case("neuron speculation on torch", "handler.neuron.speculation.draft_checkpoint: set, but "
         "handler.backend is 'torch'", handler={"neuron": {"speculation": {
             "draft_checkpoint": "draft"}}}),
    Case("as built", None),
    Case("sharded", None, shard),
    Case("asyncCommunication left out", None, drop=("asyncCommunication",)),
    Case("no chat template", None, no_chat_template, warns="no chat template"),
    Case("generation_config sampling", None, sampling),
    # 7: sampling values out of range: said, not used
    Case("generation_config out of range", None,
         edit_json("generation_config.json", top_p=2.0, temperature=-1),
         # temperature is set in the YAML, so the file's is not read (nor reported)
         warns="generation_config.json: top_p 2.0 is not used as a default (outside (0, 1], "
               "the range a request may ask for); fix the file, or set handler.defaults.top_p"),
]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def refused_in_one_line(code: int, err: str, expected: str) -> None:
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert expected in err, err


class Handler(GenerationHandler):
    _observer = staticmethod(lambda context, config: None)  # no TorchServe metrics here


def start_worker(model_dir: Path) -> Handler:
    """A worker's start on an archive folder, as TorchServe calls it."""
    raw = yaml.safe_load((model_dir / "model-config.yaml").read_text())
    context = SimpleNamespace(model_yaml_config=raw,
                              system_properties={"model_dir": str(model_dir)})
    handler = Handler()
    handler.initialize(context)
    return handler


def archive_without_package(root: Path, ckpt: Path, config: Path) -> Path:
    """What the archive would hold, had packaging let it through."""
    shutil.copytree(ckpt, root / "model")
    shutil.copy(config, root / "model-config.yaml")
    return root


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_package_and_the_worker_start_agree(case: Case, tiny_checkpoint: Path, tmp_path: Path,
                                            capsys, caplog) -> None:
    ckpt = shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")
    case.damage(ckpt)
    config = write_config(tmp_path / "c.yaml", case.handler, drop=case.drop, append=case.append)
    store = tmp_path / "store"
    code, out, err = run(capsys, "package", "--config", str(config), "--checkpoint", str(ckpt),
                         "--name", "t", "--format", "no-archive", "--out", str(store))
    if case.refused is not None:
        refused_in_one_line(code, err, case.refused)
        assert not store.exists()
        model_dir = archive_without_package(tmp_path / "archive", ckpt, config)
        with pytest.raises(Exception) as info:
            start_worker(model_dir)
        expected = case.refused if case.worker_refused is None else case.worker_refused
        assert expected in str(info.value)
        return
    assert code == 0, err
    with caplog.at_level(logging.WARNING, logger="handlers.checkpoint_checks"):
        handler = start_worker(store / "t")
    try:
        assert handler.initialized
        warned = [line for line in out.splitlines() if line.startswith("warning: ")]
        if case.warns is None:
            assert not warned and "warning" not in caplog.text.lower(), (out, caplog.text)
        else:
            assert any(case.warns in line for line in warned), out
            assert case.warns in caplog.text
        if case.id == "generation_config sampling":
            d = handler.service.config.handler.defaults
            assert (d.temperature, d.top_p, d.top_k) == (0.0, 0.9, 40)  # YAML's temperature wins
    finally:
        handler.service.engine.stop()


# --- model-config.yaml ---

@pytest.mark.parametrize("text", ["", "# only a comment\n\n"])
@pytest.mark.parametrize("command", ["package", "validate"])
def test_an_empty_model_config_is_refused(text: str, command: str, tiny_checkpoint: Path,
                                          tmp_path: Path, capsys) -> None:
    config = tmp_path / "model-config.yaml"
    config.write_text(text)
    args = ["--config", str(config), "--checkpoint", str(tiny_checkpoint), "--name", "t",
            "--out", str(tmp_path / "store")] if command == "package" else [str(config)]
    code, _, err = run(capsys, command, *args)
    refused_in_one_line(code, err, f"{config}: empty; TorchServe 0.12 fails")


def test_package_writes_the_frontend_keys_the_yaml_leaves_out(tiny_checkpoint: Path,
                                                              tmp_path: Path, capsys) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("# mine\nhandler:\n  max_length: 512\n  max_new_tokens_limit: 256\n")
    code, out, _ = run(capsys, "package", "--config", str(config), "--checkpoint",
                       str(tiny_checkpoint), "--name", "t", "--format", "no-archive", "--out",
                       str(tmp_path / "store"))
    assert code == 0 and "note: c.yaml leaves out asyncCommunication" in out
    text = (tmp_path / "store" / "t" / "model-config.yaml").read_text()
    assert "# mine\n" in text  # the user's file, comments and all, below the added keys
    data = yaml.safe_load(text)
    assert {k: data[k] for k in load_checks.WRITTEN_FRONTEND} == {
        "asyncCommunication": True, "batchSize": 1, "continuousBatching": False,
        "responseTimeout": 300, "startupTimeout": 600}
    assert data["handler"] == {"max_length": 512, "max_new_tokens_limit": 256}


def test_a_file_that_would_not_parse_back_is_rewritten() -> None:
    text = "---\nhandler: {backend: torch}\n"
    raw = yaml.safe_load(text)
    out = load_checks.archive_yaml(text, raw, {"asyncCommunication": True})
    assert yaml.safe_load(out) == {"handler": {"backend": "torch"}, "asyncCommunication": True}


@pytest.mark.parametrize("frontend, key", [({"asyncCommunication": False}, "asyncCommunication"),
                                           ({"batchSize": 4}, "batchSize"),
                                           ({"continuousBatching": True}, "continuousBatching")])
def test_explicitly_wrong_frontend_keys_are_refused(frontend: dict, key: str,
                                                     tiny_checkpoint: Path, tmp_path: Path,
                                                     capsys) -> None:
    config = write_config(tmp_path / "c.yaml", frontend=frontend)
    code, _, err = run(capsys, "package", "--config", str(config), "--checkpoint",
                       str(tiny_checkpoint), "--name", "t", "--out", str(tmp_path / "store"))
    refused_in_one_line(code, err, f"error: {key}: ")


def test_the_worker_refuses_an_archive_yaml_without_async(tiny_checkpoint: Path,
                                                          tmp_path: Path) -> None:
    """TorchServe's default is false: the worker would answer every request with 503."""
    raw = yaml.safe_load(write_config(tmp_path / "c.yaml", drop=("asyncCommunication",))
                         .read_text())
    shutil.copytree(tiny_checkpoint, tmp_path / "model")
    with pytest.raises(ConfigError, match="asyncCommunication: absent .* add "
                                          "`asyncCommunication: true`"):
        load_worker_config(raw, tmp_path)


# --- validate --checkpoint and compile ---

def test_validate_checkpoint_refuses_what_package_refuses(tiny_checkpoint: Path,
                                                          tmp_path: Path, capsys) -> None:
    ckpt = shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")
    cut_short(ckpt)
    code, _, err = run(capsys, "validate", str(write_config(tmp_path / "c.yaml")),
                       "--checkpoint", str(ckpt))
    refused_in_one_line(code, err, "file cut short")


@pytest.mark.parametrize("backend", ["torch", "neuron", "nxdi"])
def test_max_length_over_positions_for_every_backend(backend: str, tiny_checkpoint: Path,
                                                     tmp_path: Path, capsys) -> None:
    config, ckpt = str(write_config(tmp_path / "c.yaml", {"backend": backend,
                                                         "max_length": 4096})), str(tiny_checkpoint)
    for argv in (["package", "--config", config, "--checkpoint", ckpt, "--name", "t", "--out",
                  str(tmp_path / "store")], ["validate", config, "--checkpoint", ckpt]):
        code, _, err = run(capsys, *argv)
        refused_in_one_line(code, err, "handler.max_length: 4096 exceeds the checkpoint's "
                                       "max_position_embeddings 2048")


def test_the_synthetic_device_has_no_positions_to_outgrow(tiny_checkpoint: Path,
                                                          tmp_path: Path, capsys) -> None:
    config = write_config(tmp_path / "c.yaml", {
        "backend": "synthetic", "max_length": 2048, "synthetic": {"decode_step_ms": 1}})
    code, _, err = run(capsys, "package", "--config", str(config), "--checkpoint",
                       str(tiny_checkpoint), "--name", "t", "--out", str(tmp_path / "store"),
                       "--dry-run")
    assert code == 0, err


@pytest.fixture
def neuron_archive(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    from archive_tools.package import package

    config = write_config(tmp_path / "n.yaml", {"backend": "neuron"}, {"deviceType": "neuron"})
    return package(config, tiny_checkpoint, "n", "no-archive", tmp_path / "store")


def test_compile_refuses_an_archive_the_worker_would_refuse(neuron_archive: Path,
                                                            capsys) -> None:
    yaml_path = neuron_archive / "model-config.yaml"
    good = yaml_path.read_text()
    yaml_path.write_text("\n".join(line for line in good.splitlines()
                                   if not line.startswith("asyncCommunication")))
    code, _, err = run(capsys, "compile", str(neuron_archive), "--dry-run")
    refused_in_one_line(code, err, "asyncCommunication: absent")
    yaml_path.write_text(good)
    cut_short(neuron_archive / "model")
    code, _, err = run(capsys, "compile", str(neuron_archive), "--dry-run")
    refused_in_one_line(code, err, "file cut short")


# --- chat template ---

def test_no_chat_template_warns_at_packaging_and_chat_answers_400(tiny_checkpoint: Path,
                                                                  tmp_path: Path,
                                                                  capsys) -> None:
    ckpt = shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")
    no_chat_template(ckpt)
    warning = f"warning: no chat template: /v1/chat/completions will answer 400; {NO_TEMPLATE_FIX}"
    config = write_config(tmp_path / "c.yaml")
    code, out, _ = run(capsys, "validate", str(config), "--checkpoint", str(ckpt))
    assert code == 0 and warning in out
    code, out, _ = run(capsys, "package", "--config", str(config), "--checkpoint", str(ckpt),
                       "--name", "t", "--out", str(tmp_path / "store"), "--dry-run")
    assert code == 0 and warning in out
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    with pytest.raises(RequestError) as info:
        render_chat(tokenizer, [{"role": "user", "content": "hi"}])
    assert info.value.status == 400 and NO_TEMPLATE_FIX in info.value.message
    # a preset in the config is a template: no warning, chat renders
    config = write_config(tmp_path / "p.yaml", {"chat_template": "llama-2"})
    code, out, _ = run(capsys, "validate", str(config), "--checkpoint", str(ckpt))
    assert code == 0 and "no chat template" not in out


def test_a_tokenizer_template_that_fails_on_a_conversation_is_refused(tiny_checkpoint: Path,
                                                                      tmp_path: Path,
                                                                      capsys) -> None:
    """It compiles (the worker's check passes) but fails on every user/assistant/user chat:
    validate and package render the probe conversation and name the template."""
    ckpt = shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")
    edit_json("tokenizer_config.json", chat_template="{% for m in messages %}"
              "{% if m['role'] == 'assistant' %}{{ raise_exception('no assistant turns') }}"
              "{% endif %}{{ m['content'] }}{% endfor %}")(ckpt)
    config = str(write_config(tmp_path / "c.yaml"))
    for argv in (["validate", config, "--checkpoint", str(ckpt)],
                 ["package", "--config", config, "--checkpoint", str(ckpt), "--name", "t",
                  "--out", str(tmp_path / "store")]):
        code, _, err = run(capsys, *argv)
        refused_in_one_line(code, err, f"the tokenizer's chat template ({ckpt.resolve()}) does "
                                       "not render a user/assistant/user conversation: ")
        assert "no assistant turns" in err
    assert not (tmp_path / "store").exists()


def test_a_draft_checkpoint_on_torch_is_refused(tiny_checkpoint: Path, tmp_path: Path,
                                                capsys) -> None:
    code, _, err = run(capsys, "package", "--config", str(write_config(tmp_path / "c.yaml")),
                       "--checkpoint", str(tiny_checkpoint), "--draft-checkpoint",
                       str(tiny_checkpoint), "--name", "t", "--out", str(tmp_path / "store"))
    refused_in_one_line(code, err, f"--draft-checkpoint {tiny_checkpoint}: speculative decoding "
                                   "runs on the Neuron backends only (neuron, nxdi), and "
                                   "handler.backend is 'torch'")


# --- generation_config.json ---

@pytest.mark.parametrize("generation, max_top_k, taken", [
    ({"do_sample": True, "temperature": 0.6, "top_p": 0.9}, None,
     {"temperature": 0.6, "top_p": 0.9}),
    ({"do_sample": False, "temperature": 0.6, "top_p": 0.9}, None, {"temperature": 0.0}),
    ({"temperature": 0.9, "top_p": 0.6}, None, {"temperature": 0.9, "top_p": 0.6}),
    ({"top_k": 50}, 32, {}),  # above what the backend honours: a request would be refused
    ({"top_p": 0, "temperature": -1, "top_k": True}, None, {}),  # out of a request's range
    ({"bos_token_id": 1, "eos_token_id": 2}, None, {}),  # transformers' defaults do not count
])
def test_checkpoint_sampling_takes_only_what_the_file_sets(generation: dict,
                                                          max_top_k: int | None,
                                                          taken: dict) -> None:
    assert checkpoint_sampling(generation, max_top_k) == taken


def test_model_config_defaults_win_over_the_checkpoints(tmp_path: Path) -> None:
    sampling(tmp_path)
    raw = {"handler": {"defaults": {"top_p": 0.5}}}
    config, taken = apply_generation_defaults(parse_config(raw), raw, tmp_path)
    assert taken == {"temperature": 0.7, "top_k": 40}
    d = config.handler.defaults
    assert (d.temperature, d.top_p, d.top_k) == (0.7, 0.5, 40)


def test_validate_names_the_generation_defaults_it_took(tiny_checkpoint: Path, tmp_path: Path,
                                                        capsys) -> None:
    ckpt = shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")
    sampling(ckpt)
    code, out, _ = run(capsys, "validate", str(write_config(tmp_path / "c.yaml")),
                       "--checkpoint", str(ckpt))
    assert code == 0
    assert (f"note: handler.defaults from {ckpt / 'generation_config.json'}: top_p 0.9, "
            "top_k 40") in out


def test_validate_names_the_generation_values_it_left_out_and_why(tiny_checkpoint: Path,
                                                                  tmp_path: Path,
                                                                  capsys) -> None:
    ckpt = shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")
    edit_json("generation_config.json", top_p=2.0, temperature=-1)(ckpt)
    config = write_config(tmp_path / "c.yaml", {"defaults": {"max_new_tokens": 32}})
    code, out, _ = run(capsys, "validate", str(config), "--checkpoint", str(ckpt))
    assert code == 0, out
    where = ckpt / "generation_config.json"
    for key, value, why in (("top_p", "2.0", "outside (0, 1]"),
                            ("temperature", "-1", "outside [0, 100]")):
        assert (f"warning: {where}: {key} {value} is not used as a default ({why}, the range "
                f"a request may ask for); fix the file, or set handler.defaults.{key}") in out
