"""`inf2serve validate`: shipped configs pass; impossible placements fail with the numbers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from archive_tools.cli import main
from archive_tools.validate_cmd import (
    ARCHITECTURES,
    INSTANCES,
    Arch,
    arch_from_config_json,
    checkpoint_weights,
    validate,
)
from handlers.config import load_config, parse_config

CONFIGS = Path(__file__).resolve().parents[2] / "model_configs"
SHIPPED = sorted(CONFIGS.glob("llama-2-*/*.yaml"))


def _instance(path: Path) -> str:
    return re.match(r"inf2\.\d*xlarge", path.name).group(0)


def test_the_shipped_set_covers_every_size() -> None:
    sizes = {p.parent.name for p in SHIPPED}
    assert sizes >= {"llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-2-7b-chat",
                     "llama-2-13b-chat", "llama-2-70b-chat"}
    assert {_instance(p) for p in SHIPPED} == set(INSTANCES)
    assert {p.name.rsplit("-", 1)[1] for p in SHIPPED} == {"latency.yaml", "throughput.yaml",
                                                           "speculation.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_config_validates_on_its_instance(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.handler.backend == "neuron" and cfg.frontend.async_communication
    arch = ARCHITECTURES[cfg.handler.neuron.architecture]
    report = validate(cfg, arch, _instance(path))
    assert report.problems == []
    if path.name.endswith(("latency.yaml", "speculation.yaml")):
        assert cfg.handler.batch_size == 1
    else:
        assert cfg.handler.batch_size >= 4
    assert main(["validate", str(path), "--instance", _instance(path)]) == 0


@pytest.mark.parametrize("path", [p for p in SHIPPED if "70b" in p.parent.name
                                  and "int8" not in p.name and "speculation" not in p.name],
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_70b_ships_on_tp24_with_padding_and_replication_warned(path: Path, capsys) -> None:
    cfg = load_config(path)
    assert cfg.handler.neuron.tp_degree == 24 and _instance(path) == "inf2.48xlarge"
    assert main(["validate", str(path), "--instance", "inf2.48xlarge"]) == 0
    out = capsys.readouterr().out
    assert ("warning: tp_degree 24: 64 attention heads are padded to 72 (3 per NeuronCore, "
            "8 zero heads: +12.5% attention compute and weights)") in out
    assert "no tp_degree that divides 64 fits in device memory here" in out
    assert ("warning: tp_degree 24: 8 K/V heads do not divide over 24 cores; transformers-neuronx "
            "replicates them 3x to 24 (1 per NeuronCore in the KV cache") in out
    assert out.rstrip().endswith("ok on inf2.48xlarge (2 warning(s))")


def test_the_other_shipped_configs_have_no_warnings() -> None:
    for path in SHIPPED:
        if "70b" not in path.parent.name or "int8" in path.name:
            cfg = load_config(path)
            arch = ARCHITECTURES[cfg.handler.neuron.architecture]
            assert validate(cfg, arch, _instance(path)).warnings == [], path


def _seventy_b(tmp_path: Path, tp: int, **neuron) -> Path:
    data = yaml.safe_load((CONFIGS / "llama-2-70b" / "inf2.48xlarge-latency.yaml").read_text())
    data["handler"]["neuron"].update(tp_degree=tp, **neuron)
    out = tmp_path / "70b.yaml"
    out.write_text(yaml.safe_dump(data))
    return out


def test_70b_on_xlarge_is_rejected_with_required_and_available_memory(tmp_path: Path,
                                                                      capsys) -> None:
    assert main(["validate", str(_seventy_b(tmp_path, 2)), "--instance", "inf2.xlarge"]) == 1
    out = capsys.readouterr().out
    assert "needs 69.4 GB per NeuronCore at tp_degree 2" in out
    assert "a core has 14.6 GB available" in out
    assert "needs 138.8 GB in all, but inf2.xlarge has 29.2 GB available" in out
    assert "no tp_degree up to 2 fits; use a larger instance" in out


def test_70b_at_tp8_names_the_smallest_tp_that_fits(tmp_path: Path, capsys) -> None:
    assert main(["validate", str(_seventy_b(tmp_path, 8)), "--instance", "inf2.48xlarge"]) == 1
    out = capsys.readouterr().out
    assert "needs 17.3 GB per NeuronCore at tp_degree 8" in out
    assert "use tp_degree 12" in out  # batch 1: 13.5 GB weights + 1.0 GB of 8x replicated KV


def test_tp_the_runtime_does_not_support_is_rejected(tmp_path: Path, capsys) -> None:
    assert main(["validate", str(_seventy_b(tmp_path, 16)), "--instance", "inf2.48xlarge"]) == 1
    out = capsys.readouterr().out
    assert ("error: tp_degree 16: the Neuron runtime on Inf2 supports tensor-parallel degrees "
            "1, 2, 4, 8, 24 (12 per AWS's LLM inference guide); use one of 1, 2, 4, 8, 12, 24 on "
            "inf2.48xlarge") in out


def test_tp_larger_than_the_instance_is_rejected(tmp_path: Path, capsys) -> None:
    assert main(["validate", str(_seventy_b(tmp_path, 24)), "--instance", "inf2.24xlarge"]) == 1
    out = capsys.readouterr().out
    assert ("error: tp_degree 24 needs 24 NeuronCores, but inf2.24xlarge has 12; use one of 1, 2, "
            "4, 8, 12, or inf2.48xlarge") in out
    assert "maxWorkers" not in out  # one message for one cause


@pytest.mark.parametrize("instance,allowed", [
    ("inf2.xlarge", "1 or 2"), ("inf2.8xlarge", "1 or 2"), ("inf2.24xlarge", "1, 2, 4, 8 or 12"),
    ("inf2.48xlarge", "1, 2, 4, 8, 12 or 24"),
])
def test_allowed_tp_is_reported_per_instance(instance: str, allowed: str) -> None:
    report = validate(_cfg(tp_degree=2), None, instance)
    assert f"{instance}: " in report.notes[0] and f"tp_degree {allowed} fit" in report.notes[0]


def _cfg(batch_size: int = 4, **neuron):
    return parse_config({"deviceType": "neuron",
                         "handler": {"backend": "neuron", "max_length": 2048,
                                     "batch_size": batch_size, "neuron": neuron}})


def test_tp12_is_accepted_with_a_warning_about_the_sources() -> None:
    report = validate(_cfg(tp_degree=12), ARCHITECTURES["llama-2-7b"], "inf2.24xlarge")
    assert report.problems == []
    assert any("tp_degree 12: listed by AWS's LLM inference guide" in w for w in report.warnings)


def test_head_padding_is_a_warning_with_the_padded_numbers() -> None:
    report = validate(_cfg(tp_degree=24), ARCHITECTURES["llama-2-7b"], "inf2.48xlarge")
    assert report.problems == []
    assert report.warnings == [
        "tp_degree 24: 32 attention heads are padded to 48 (2 per NeuronCore, 16 zero heads: "
        "+50.0% attention compute and weights); K/V weights and cache are padded alike (48 "
        "heads); tp_degree 2, 4, 8 would avoid it"]  # tp 1: 13.5 GB weights + 2.1 GB KV


def test_heads_that_divide_by_tp_are_not_padded() -> None:
    assert validate(_cfg(tp_degree=8), ARCHITECTURES["llama-2-7b"], None).warnings == []


def test_kv_replication_is_a_warning_with_the_numbers() -> None:
    arch = ARCHITECTURES["llama-2-70b"]  # 64 heads, 8 K/V heads
    assert validate(_cfg(tp_degree=8, batch_size=1), arch, None).warnings == []
    twelve = validate(_cfg(tp_degree=12, batch_size=1), arch, None).warnings
    assert any("replicates them 8x to 64 and pads them with 8 zero heads to 72 (6 per "
               "NeuronCore in the KV cache, which is 9x the unreplicated size)" in w
               for w in twelve)


def test_shard_over_batch_falls_back_like_the_library() -> None:
    arch = Arch(32, 4096, 32, 8, 128256, 14336, 8192)  # Llama-3-8B: 8 K/V heads
    kept = validate(_cfg(tp_degree=8, batch_size=8, gqa="shard-over-batch"), arch, None)
    assert [w for w in kept.warnings if not w.startswith("host sampling")] == []
    dropped = validate(_cfg(tp_degree=8, batch_size=4, gqa="shard-over-batch"), arch, None)
    assert dropped.problems == []
    assert dropped.warnings == ["gqa: gqa shard-over-batch needs batch_size 4 divisible by "
                                "tp_degree 8; transformers-neuronx falls back to "
                                "shard-over-heads"]


def test_heads_not_a_multiple_of_kv_heads_is_not_a_llama() -> None:
    arch6 = Arch(80, 8192, 64, 6, 32000, 28672, 4096)
    assert any("num_attention_heads 64 is not a multiple of num_key_value_heads 6" in p
               for p in validate(_cfg(tp_degree=8), arch6, None).problems)


def _xlarge(tmp_path: Path, workers: int) -> Path:
    data = yaml.safe_load((CONFIGS / "llama-2-7b" / "inf2.xlarge-latency.yaml").read_text())
    data["handler"]["neuron"]["compilation_worker_count"] = workers
    out = tmp_path / "x.yaml"
    out.write_text(yaml.safe_dump(data))
    return out


def test_compiling_every_graph_at_once_on_xlarge_warns_with_numbers_and_the_fix(
        tmp_path: Path, capsys) -> None:
    assert main(["validate", str(_xlarge(tmp_path, 0)), "--instance", "inf2.xlarge"]) == 0
    out = capsys.readouterr().out
    assert ("note: host memory (estimate): loading 5.2 GiB, compiling 44.5 GiB of 16 GiB "
            "(10 graphs: 6 token + 4 context buckets, 10 at a time)") in out
    assert ("warning: host memory: compiling needs about 44.5 GiB but inf2.xlarge has 16 GiB: 10 "
            "of 10 graphs compile at once (handler.neuron.compilation_worker_count 0 = all at "
            "once) at an assumed 4 GiB per neuronx-cc process") in out
    assert "set compilation_worker_count to 2 or lower" in out
    assert "compile on a larger host with `inf2serve compile` and ship the cache" in out


def test_one_graph_at_a_time_fits_xlarge(tmp_path: Path, capsys) -> None:
    assert main(["validate", str(_xlarge(tmp_path, 1)), "--instance", "inf2.xlarge"]) == 0
    out = capsys.readouterr().out
    assert "compiling 8.5 GiB of 16 GiB" in out and "warning" not in out


EMPTY_SAFETENSORS = (2).to_bytes(8, "little") + b"{}"  # a valid file of no tensors


def _checkpoint(tmp_path: Path, dtype: str, *files: str, tokenizer_from: Path | None = None
                ) -> Path:
    """A Llama-2-7B config.json, the tokenizer of `tokenizer_from`, and weight files that
    hold nothing (safetensors with an empty header; other files empty)."""
    import shutil

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
        "num_attention_heads": 32, "vocab_size": 32000, "intermediate_size": 11008,
        "max_position_embeddings": 4096, "torch_dtype": dtype}))
    for name in files:
        (ckpt / name).write_bytes(EMPTY_SAFETENSORS if name.endswith(".safetensors") else b"")
    for f in (tokenizer_from.iterdir() if tokenizer_from else ()):
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, ckpt / f.name)
    return ckpt


def test_pickled_weights_alone_are_refused_with_the_fix_and_would_not_fit_xlarge(
        tmp_path: Path, capsys, tiny_checkpoint: Path) -> None:
    """A pytorch_model.bin checkpoint is refused by the same checks package runs (prepare
    converts it); were it served, torch.load() would read it whole: 29.1 GiB on a 16 GiB
    host, which the host-memory estimate still says."""
    ckpt = _checkpoint(tmp_path, "float32", "pytorch_model.bin", tokenizer_from=tiny_checkpoint)
    cfg = _xlarge(tmp_path, 1)
    assert main(["validate", str(cfg), "--instance", "inf2.xlarge", "--checkpoint",
                 str(ckpt)]) != 0
    assert "run `inf2serve prepare SRC OUT`" in capsys.readouterr().err
    arch = arch_from_config_json(json.loads((ckpt / "config.json").read_text()))
    report = validate(load_config(cfg), arch, "inf2.xlarge", weights=checkpoint_weights(ckpt))
    warning = next(w for w in report.warnings if w.startswith("host memory"))
    assert "loading weights needs about 29.1 GiB but inf2.xlarge has 16 GiB" in warning
    assert "use safetensors (`inf2serve prepare` writes them" in warning


def test_safetensors_load_layer_by_layer(tmp_path: Path, capsys, tiny_checkpoint: Path) -> None:
    ckpt = _checkpoint(tmp_path, "float32", "model.safetensors", "pytorch_model.bin",
                       tokenizer_from=tiny_checkpoint)
    assert checkpoint_weights(ckpt).fmt == "model.safetensors"  # the real loader's first choice
    cfg = _xlarge(tmp_path, 1)
    arch = arch_from_config_json(json.loads((ckpt / "config.json").read_text()))
    report = validate(load_config(cfg), arch, "inf2.xlarge", weights=checkpoint_weights(ckpt))
    assert not report.problems and not report.warnings
    # weights that hold nothing are no Llama-2-7B: the load checks say which tensor is missing
    assert main(["validate", str(cfg), "--instance", "inf2.xlarge", "--checkpoint",
                 str(ckpt)]) == 2
    assert ("model_type 'llama' needs tensor 'model.embed_tokens.weight' [32000, 4096], which "
            "no weight file holds") in capsys.readouterr().err


def test_unknown_architecture_names_the_closest(tmp_path: Path, capsys) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"handler": {"backend": "neuron",
                                                "neuron": {"architecture": "llama2-7b"}}}))
    assert main(["validate", str(path)]) == 2
    assert "did you mean 'llama-2-7b'" in capsys.readouterr().err


def test_unknown_key_names_the_closest(tmp_path: Path, capsys) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"handler": {"backend": "neuron",
                                                "neuron": {"tp_degre": 2}}}))
    assert main(["validate", str(path)]) == 2
    assert "did you mean 'tp_degree'" in capsys.readouterr().err


def test_checkpoint_config_json_is_used(tmp_path: Path, capsys, tiny_checkpoint: Path) -> None:
    import shutil

    for f in tiny_checkpoint.iterdir():  # its weights and tokenizer; this config.json
        if f.name != "config.json":
            shutil.copy(f, tmp_path / f.name)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2, '
                                          '"hidden_size": 64, '
                                          '"num_attention_heads": 4, "num_key_value_heads": 2, '
                                          '"vocab_size": 1024, "intermediate_size": 172, '
                                          '"max_position_embeddings": 512}')
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"handler": {"backend": "neuron", "max_length": 512,
                                                "max_new_tokens_limit": 256,
                                                "neuron": {"tp_degree": 2}}}))
    assert main(["validate", str(path), "--checkpoint", str(tmp_path),
                 "--instance", "inf2.xlarge"]) == 0
    path.write_text(yaml.safe_dump({"handler": {"backend": "neuron", "max_length": 1024,
                                                "neuron": {"tp_degree": 2}}}))
    assert main(["validate", str(path), "--checkpoint", str(tmp_path)]) != 0
    out = capsys.readouterr()
    assert "exceeds the checkpoint's max_position_embeddings 512" in out.out + out.err


def test_the_readme_example_output_is_what_validate_prints(capsys, monkeypatch) -> None:
    monkeypatch.chdir(CONFIGS.parent)  # the README's paths are relative to the repository
    readme = Path("docs/inferentia2.md").read_text(encoding="utf-8")
    block = readme.split("Check a config before you deploy", 1)[1].split("```bash\n", 1)[1]
    runs = block.split("```", 1)[0].split("inf2serve ")[1:]
    assert len(runs) == 2
    for run in runs:
        command, *shown = run.strip().splitlines()
        code = main(command.split())
        out = capsys.readouterr().out
        assert code == (1 if any(s.startswith("# error") for s in shown) else 0)
        for line in shown:
            assert line.removeprefix("# ").removesuffix(" ...") in out, line


QUANTIZED = sorted(CONFIGS.glob("llama-*/*int8*.yaml"))


@pytest.mark.parametrize("path", QUANTIZED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_int8_configs_fit_their_instance_with_weights_at_about_half_of_bf16(path: Path,
                                                                         capsys) -> None:
    """Each shipped int8 config validates on its instance, and `validate` prints its weights
    at int8: about half of the same config's in bf16 (the LM head and norms stay bf16)."""
    assert main(["validate", str(path), "--instance", _instance(path)]) == 0
    out = capsys.readouterr().out
    int8 = float(re.search(r"weights ([\d.]+) GB at int8", out).group(1))
    data = yaml.safe_load(path.read_text())
    del data["handler"]["neuron"]["quantization"]
    cfg = parse_config(data)
    arch = ARCHITECTURES[cfg.handler.neuron.architecture]
    note = next(n for n in validate(cfg, arch, None).notes if n.startswith("device memory"))
    plain = float(re.search(r"weights ([\d.]+) GB at (bf16|f16)", note).group(1))
    assert 0.45 < int8 / plain < 0.6, (int8, plain)


def test_int8_makes_70b_and_13b_fit_instances_they_do_not_fit_in_bf16() -> None:
    for name in ("llama-2-70b/inf2.24xlarge-int8-latency.yaml",
                 "llama-2-13b/inf2.8xlarge-int8-throughput.yaml"):
        data = yaml.safe_load((CONFIGS / name).read_text())
        del data["handler"]["neuron"]["quantization"]
        cfg = parse_config(data)
        arch = ARCHITECTURES[cfg.handler.neuron.architecture]
        problems = validate(cfg, arch, _instance(Path(name))).problems
        assert any("device memory" in p for p in problems), (name, problems)


SPECULATIVE = sorted(CONFIGS.glob("llama-*/*speculation*.yaml"))


@pytest.mark.parametrize("path", SPECULATIVE, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_speculation_configs_count_the_draft_and_fit(path: Path, capsys) -> None:
    assert main(["validate", str(path), "--instance", _instance(path)]) == 0
    out = capsys.readouterr().out
    assert "speculation: the figures include the draft" in out
    data = yaml.safe_load(path.read_text())
    cfg = parse_config(data)
    arch = ARCHITECTURES[cfg.handler.neuron.architecture]
    with_draft = float(re.search(r"takes ([\d.]+) GB per NeuronCore", out).group(1))
    del data["handler"]["neuron"]["speculation"]
    alone = next(n for n in validate(parse_config(data), arch, None).notes
                 if n.startswith("device memory"))
    assert with_draft > float(re.search(r"takes ([\d.]+) GB", alone).group(1))


def test_nxdi_int8_warns_when_quantizing_would_not_fit_the_host(tmp_path: Path, capsys) -> None:
    """NxD Inference writes its int8 checkpoint from the model loaded in float32, once: 7B on
    a 16 GiB inf2.xlarge does not fit, which validate says with the way out."""
    data = yaml.safe_load((CONFIGS / "nxdi" / "llama-2-7b" / "inf2.xlarge-latency.yaml")
                          .read_text())
    data["handler"]["neuron"]["quantization"] = {"weights": "int8"}
    path = tmp_path / "q.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["validate", str(path), "--instance", "inf2.xlarge"]) == 0
    out = capsys.readouterr().out
    assert "weights 3.50 GB at int8" in out
    assert "quantizing llama-2-7b for NxD Inference loads it in float32 (27.1 GiB)" in out
    assert main(["validate", str(path), "--instance", "inf2.24xlarge"]) == 0
    assert "quantizing" not in capsys.readouterr().out


def test_what_nxdi_speculation_cannot_run_is_refused_by_validate(tmp_path: Path, capsys) -> None:
    data = yaml.safe_load((CONFIGS / "nxdi" / "llama-2-7b" / "inf2.xlarge-latency.yaml")
                          .read_text())
    data["handler"]["neuron"].update(on_device_sampling=True, quantization={"weights": "int8"},
                                     speculation={"draft_checkpoint": "draft", "length": 4})
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["validate", str(path)]) == 1
    assert "backend nxdi does not run a draft with handler.neuron.quantization.weights" in (
        capsys.readouterr().out)


ALL_SHIPPED = sorted(CONFIGS.rglob("*.yaml"))


@pytest.mark.parametrize("path", [p for p in ALL_SHIPPED if "architecture:" in p.read_text()],
                         ids=lambda p: str(p.relative_to(CONFIGS)))
def test_ready_configs_past_a_100k_vocabulary_sample_on_the_device(path: Path, capsys) -> None:
    """Llama-3.x, Qwen2.5 and Qwen3 hand the host 128k-152k logits a row each step without
    on-device sampling; their ready configs sample on the device, and a config that samples
    on the host has validate print the cost."""
    cfg = load_config(path)
    vocab = ARCHITECTURES[cfg.handler.neuron.architecture].vocab
    assert cfg.handler.neuron.on_device_sampling or vocab <= 100_000, path
    assert main(["validate", str(path), "--instance", _instance(path)]) == 0
    printed = "host sampling (estimate)" in capsys.readouterr().out
    assert printed == (not cfg.handler.neuron.on_device_sampling)


@pytest.mark.parametrize("batch,vocab,expected,warned", [
    (32, 128256, "32 x 128,256 logits of every compiled line: about 1.19 ms greedy, 1.48 ms "
                 "sampled, 13% of a 10 ms step", True),
    (8, 152064, "8 x 152,064 logits of every compiled line: about 0.35 ms greedy, 0.44 ms "
                "sampled, 4% of a 10 ms step", False),
    (1, 152064, "1 x 152,064 logits of every compiled line: about 0.04 ms greedy, 0.05 ms "
                "sampled, under 1% of a 10 ms step", False),
    (1, 32000, "1 x 32,000 logits of every compiled line: about 0.01 ms greedy, 0.01 ms "
               "sampled, under 1% of a 10 ms step", False),
])
def test_host_sampling_cost_is_printed_with_its_numbers(batch, vocab, expected, warned) -> None:
    """The rates are bench/results/host_sampling_device.md's (transformers-neuronx's logits of
    64 compiled lines at 128,256 tokens: 2.40 ms greedy, 2.95 ms sampled a 10 ms step): past
    5% of a step, a warning."""
    arch = Arch(32, 4096, 32, 8, vocab, 14336, 8192)
    report = validate(_cfg(tp_degree=8, batch_size=batch), arch, None)
    lines = [x for x in report.warnings + report.notes if x.startswith("host sampling")]
    assert len(lines) == 1 and expected in lines[0]
    assert (lines[0] in report.warnings) == warned
    assert "on_device_sampling: true" in lines[0]
    on_device = validate(_cfg(tp_degree=8, batch_size=batch, on_device_sampling=True), arch, None)
    assert not [x for x in on_device.warnings + on_device.notes if x.startswith("host sampling")]


def test_nxdi_host_sampling_cost_reads_its_float32_rows() -> None:
    """NxD Inference hands back float32 rows: 1.10 ms greedy and 1.55 ms sampled a step at
    32 x 128,256 (bench/results/host_sampling_device.md)."""
    from archive_tools.host_sampling_cost import host_sampling_line

    line, warned = host_sampling_line(32, 128256, "nxdi")
    assert "32 x 128,256 float32 logits: about 1.11 ms greedy, 1.56 ms sampled, 13%" in line
    assert warned
