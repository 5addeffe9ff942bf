"""`inf2serve demo-model` keeps a demo model already there, so the quick start runs after
`make demo`, and still refuses to overwrite anything else; `--arch` writes each family's
checkpoint with its config conventions, special tokens and real chat template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from archive_tools.cli import main
from archive_tools.demo_families import FAMILIES

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_existing_demo_model_is_kept(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "tiny-llama"
    shutil.copytree(tiny_checkpoint, out)
    before = (out / "model.safetensors").stat().st_mtime_ns
    assert main(["demo-model", str(out)]) == 0
    assert "already holds the tiny llama demo model; kept" in capsys.readouterr().out
    assert (out / "model.safetensors").stat().st_mtime_ns == before


def test_other_contents_are_refused(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "tiny-llama"
    shutil.copytree(tiny_checkpoint, out)
    assert main(["demo-model", str(out), "--size", "bench"]) == 2  # another size
    assert main(["demo-model", str(out), "--arch", "mistral"]) == 2  # another family
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert main(["demo-model", str(tmp_path / "other")]) == 2
    assert "pass --force to replace it" in capsys.readouterr().err


def test_an_unknown_arch_is_refused_with_the_choices(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo-model", str(tmp_path / "x"), "--arch", "gemma"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--arch" in err and "qwen3" in err and "mixtral" in err


@pytest.fixture(scope="module")
def family_dirs(family_checkpoint) -> dict[str, Path]:
    return {arch: family_checkpoint(arch)
            for arch in ("qwen2", "qwen3", "mistral", "mistral-v0.1", "mixtral")}


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_each_family_loads_as_its_transformers_class(family_dirs) -> None:
    from transformers import AutoModelForCausalLM

    classes = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "mistral": "MistralForCausalLM", "mistral-v0.1": "MistralForCausalLM",
               "mixtral": "MixtralForCausalLM"}
    for arch, path in family_dirs.items():
        model = AutoModelForCausalLM.from_pretrained(path)
        assert type(model).__name__ == classes[arch]
        assert _config(path)["model_type"] == FAMILIES[arch].model_type


def test_the_config_conventions_of_each_family(family_dirs) -> None:
    from safetensors import safe_open

    def keys(arch: str) -> set[str]:
        with safe_open(str(family_dirs[arch] / "model.safetensors"), framework="pt") as f:
            return set(f.keys())

    qwen2, qwen3 = _config(family_dirs["qwen2"]), _config(family_dirs["qwen3"])
    # Qwen2: q/k/v bias, tied embeddings (no lm_head in the file), rope theta 1e6, no window
    assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias",
            "model.layers.0.self_attn.v_proj.bias"} <= keys("qwen2")
    assert "model.layers.0.self_attn.o_proj.bias" not in keys("qwen2")
    assert qwen2["tie_word_embeddings"] is True and "lm_head.weight" not in keys("qwen2")
    assert qwen2["rope_theta"] == 1e6 and qwen2["use_sliding_window"] is False
    # Qwen3: q/k norms, head_dim wider than hidden / heads, no attention bias
    assert {"model.layers.0.self_attn.q_norm.weight",
            "model.layers.0.self_attn.k_norm.weight"} <= keys("qwen3")
    assert qwen3["head_dim"] == 32 != qwen3["hidden_size"] // qwen3["num_attention_heads"]
    assert qwen3["attention_bias"] is False and "model.layers.0.self_attn.q_proj.bias" not in \
        keys("qwen3")
    # Mistral v0.3: full attention; v0.1: a 4096-token window and theta 10000
    assert _config(family_dirs["mistral"])["sliding_window"] is None
    assert _config(family_dirs["mistral"])["rope_theta"] == 1e6
    assert _config(family_dirs["mistral-v0.1"])["sliding_window"] == 4096
    assert _config(family_dirs["mistral-v0.1"])["rope_theta"] == 1e4
    # Mixtral: 8 experts, 2 per token, a router per layer
    mixtral = _config(family_dirs["mixtral"])
    assert (mixtral["num_local_experts"], mixtral["num_experts_per_tok"]) == (8, 2)
    assert any("block_sparse_moe.gate" in k or "mlp.gate" in k for k in keys("mixtral"))


def test_qwen_stops_on_im_end_and_endoftext_and_has_no_bos(family_dirs) -> None:
    from transformers import AutoTokenizer

    for arch in ("qwen2", "qwen3"):
        tok = AutoTokenizer.from_pretrained(family_dirs[arch])
        gen = json.loads((family_dirs[arch] / "generation_config.json").read_text())
        assert gen["eos_token_id"] == tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
        assert gen["pad_token_id"] == tok.convert_tokens_to_ids("<|endoftext|>")
        assert tok.bos_token is None and tok.eos_token == "<|im_end|>"


@pytest.mark.parametrize("arch,tokens", [
    ("qwen2", ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]),
    ("qwen3", ["<|im_start|>", "<|im_end|>", "<tool_call>", "<think>", "</think>",
               "<tool_response>"]),
    ("mistral", ["<s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                 "[TOOL_RESULTS]"]),
])
def test_the_family_tokens_are_single_tokens(family_dirs, arch, tokens) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(family_dirs[arch])
    for text in tokens:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids) == [text], text


def test_qwen_tool_and_think_tags_decode_as_text_mistral_control_tokens_do_not(
        family_dirs) -> None:
    """As in the published tokenizers: Qwen's <tool_call> and <think> are added tokens with
    special=False (the hermes and qwen3 parsers read them from the text); Mistral's
    [TOOL_CALLS] is special (skipped unless skip_special_tokens is off)."""
    from transformers import AutoTokenizer

    qwen3 = AutoTokenizer.from_pretrained(family_dirs["qwen3"])
    text = "<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>"
    ids = qwen3(text, add_special_tokens=False)["input_ids"]
    assert qwen3.decode(ids, skip_special_tokens=True) == text.removesuffix("<|im_end|>")
    mistral = AutoTokenizer.from_pretrained(family_dirs["mistral"])
    ids = mistral("[TOOL_CALLS] [{}]", add_special_tokens=False)["input_ids"]
    assert mistral.decode(ids, skip_special_tokens=True) == " [{}]"


def test_each_family_renders_its_own_chat_format(family_dirs) -> None:
    from transformers import AutoTokenizer

    def render(arch: str, **kw) -> str:
        tok = AutoTokenizer.from_pretrained(family_dirs[arch])
        return tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, **kw)

    assert render("qwen2") == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                               "Hi there<|im_end|>\n<|im_start|>assistant\n")
    assert render("qwen3", enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render("mistral") == "<s>[INST] Be brief.\n\nHi there[/INST]"
    assert render("mixtral") == render("mistral-v0.1") == "<s> [INST] Be brief.\n\nHi there [/INST]"
    with_tools = {arch: render(arch, tools=TOOLS) for arch in ("qwen2", "qwen3", "mistral")}
    assert "<tools>\n{\"type\": \"function\"" in with_tools["qwen2"]
    assert "<tool_call></tool_call> XML tags" in with_tools["qwen3"]
    assert with_tools["mistral"].startswith("<s>[AVAILABLE_TOOLS] [{\"type\": \"function\", "
                                            "\"function\": {\"name\": \"get_weather\"")


def test_the_templates_are_the_published_ones(family_dirs) -> None:
    """The stored templates are the files under archive_tools/data, byte for byte, and each
    names its source."""
    data = Path(__file__).resolve().parents[2] / "archive_tools" / "data"
    for arch, path in family_dirs.items():
        family = FAMILIES[arch]
        stored = json.loads((path / "tokenizer_config.json").read_text())["chat_template"]
        assert stored == (data / family.template_file).read_text(encoding="utf-8")
        assert "tokenizer_config.json" in family.template_source


def test_the_tool_format_probe_sees_the_tool_templates(family_dirs) -> None:
    from transformers import AutoTokenizer

    from handlers.api.chat_template import takes_tools

    found = {arch: takes_tools(AutoTokenizer.from_pretrained(path))
             for arch, path in family_dirs.items()}
    assert found == {"qwen2": True, "qwen3": True, "mistral": True, "mistral-v0.1": False,
                     "mixtral": False}


def test_the_llama_default_is_unchanged(tiny_checkpoint: Path) -> None:
    """No --arch: the Llama checkpoint demo-model has always written (the e2e tests and
    `make demo` rely on it)."""
    cfg = _config(tiny_checkpoint)
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is False
    tok_cfg = json.loads((tiny_checkpoint / "tokenizer_config.json").read_text())
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["unk_token"]) == (
        "<s>", "</s>", "<unk>")
    assert "pad_token" not in tok_cfg and tok_cfg["chat_template"].startswith(
        "{% if messages[0]['role'] == 'system' %}")


def test_the_cli_writes_a_family(tmp_path: Path, capsys) -> None:
    out = tmp_path / "tiny-qwen3"
    assert main(["demo-model", str(out), "--arch", "qwen3"]) == 0
    assert "wrote tiny qwen3 demo model" in capsys.readouterr().out
    assert main(["demo-model", str(out), "--arch", "qwen3"]) == 0  # kept
    assert "already holds the tiny qwen3 demo model; kept" in capsys.readouterr().out
