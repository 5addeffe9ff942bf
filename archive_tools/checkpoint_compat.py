"""Serving checkpoints that transformers 4.36+ and 5.x read the same way.

The Neuron SDKs ship transformers 4.x (4.36 to 4.57) while the toolkit may write with 5.x.
What a 5.x `save_pretrained` writes that 4.x misreads, and what is written instead:
- tokenizer_config.json names `TokenizersBackend` ("does not exist" in 4.x): named
  `PreTrainedTokenizerFast`, 4.x's class for a bare tokenizer.json, which 5.x resolves
  to `TokenizersBackend` again.
- tokenizer.json stores BPE merges as pairs (tokenizers >= 0.20), which tokenizers < 0.20
  (transformers < 4.45) cannot parse: stored as "a b" strings, which every version reads,
  when no merge holds a space.
- the chat template goes to chat_template.jinja, which transformers < 4.47 ignores: moved
  into tokenizer_config.json, read by every version.
- tokenizer_config.json lists extra special tokens under `extra_special_tokens` (5.x's name
  for additional_special_tokens), which 4.48+ read as a dict of named tokens and fail on
  ("'list' object has no attribute 'keys'"): written as `additional_special_tokens`, which
  every 4.x reads and 5.x renames on load (tokenization_utils_base.py, "V5: Convert
  deprecated additional_special_tokens").
- clean_up_tokenization_spaces left unset, which 4.36-4.44 read as True (decoded text
  differs): written as False, the 4.45+ and 5.x default.
- config.json carries RoPE only under `rope_parameters`; 4.x, like transformers-neuronx
  (aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/llama/config.py:L43-L48),
  reads top-level `rope_theta` (default 10000) and `rope_scaling`: both added with the same
  values, as is `torch_dtype` beside `dtype`. 5.x reads those legacy keys to the same settings.

These are JSON edits of the saved files because no transformers API writes them:
`save_pretrained` records the tokenizer's own class name, and a 5.x config serializes
only `rope_parameters` (`rope_scaling` is a property aliasing it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from handlers.transformers4_rules import TOKENIZER_CLASS_4X

CHAT_TEMPLATE_FILE = "chat_template.jinja"


def config_for_4x(config: dict[str, Any]) -> dict[str, Any]:
    """config.json with 4.x's RoPE and dtype keys beside 5.x's (a per-layer RoPE is left alone)."""
    out = dict(config)
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:  # one RoPE for every layer
        out["rope_theta"] = rope["rope_theta"]
        if "partial_rotary_factor" in rope:
            out["partial_rotary_factor"] = rope["partial_rotary_factor"]
        scaling = {k: v for k, v in rope.items()
                   if k not in ("rope_theta", "partial_rotary_factor")}
        # 4.36-4.42 accept only linear/dynamic scaling dicts; no scaling must be null there
        out["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
    if config.get("dtype") is not None:
        out["torch_dtype"] = config["dtype"]
    return out


def tokenizer_config_for_4x(config: dict[str, Any], chat_template: str | None) -> dict[str, Any]:
    """tokenizer_config.json with a class 4.x knows, the chat template inline, no cleanup,
    extra special tokens where 4.x reads them."""
    out = dict(config)
    cls = out.get("tokenizer_class")
    out["tokenizer_class"] = TOKENIZER_CLASS_4X.get(cls, cls)
    out.setdefault("clean_up_tokenization_spaces", False)
    extra = out.get("extra_special_tokens")
    if isinstance(extra, list):  # 4.48+ take only a dict of named tokens here
        del out["extra_special_tokens"]
        known = list(out.get("additional_special_tokens") or [])
        out["additional_special_tokens"] = known + [t for t in extra if t not in known]
    if chat_template is not None:  # 4.47+ and 5.x prefer chat_template.jinja over the inline one
        out["chat_template"] = chat_template
    return out


def tokenizer_json_for_old(tokenizer: dict[str, Any]) -> dict[str, Any] | None:
    """tokenizer.json with BPE merges as "a b" strings; None when there is nothing to change."""
    model = tokenizer.get("model") or {}
    merges = model.get("merges")
    if model.get("type") != "BPE" or not merges or isinstance(merges[0], str):
        return None
    if any(" " in part for pair in merges for part in pair):
        return None  # only the pair form can hold a space; such a tokenizer needs tokenizers>=0.20
    return {**tokenizer, "model": {**model, "merges": [" ".join(pair) for pair in merges]}}


def make_compatible(ckpt: Path) -> None:
    """Rewrite the JSON files of a checkpoint directory being built (not yet published)."""
    ckpt = Path(ckpt)
    if (ckpt / "config.json").is_file():
        config = json.loads((ckpt / "config.json").read_text("utf-8"))
        _write(ckpt / "config.json", config_for_4x(config), sort_keys=True)
    tok_path, jinja = ckpt / "tokenizer_config.json", ckpt / CHAT_TEMPLATE_FILE
    if tok_path.is_file():
        template = jinja.read_text("utf-8") if jinja.is_file() else None
        tok = json.loads(tok_path.read_text("utf-8"))
        _write(tok_path, tokenizer_config_for_4x(tok, template), sort_keys=True)
        if template is not None:
            jinja.unlink()  # one copy of the template, the one every version reads
    if (ckpt / "tokenizer.json").is_file():
        fixed = tokenizer_json_for_old(json.loads((ckpt / "tokenizer.json").read_text("utf-8")))
        if fixed is not None:
            _write(ckpt / "tokenizer.json", fixed)


def _write(path: Path, data: dict[str, Any], sort_keys: bool = False) -> None:
    text = json.dumps(data, indent=2, sort_keys=sort_keys, ensure_ascii=False) + "\n"
    path.write_text(text, encoding="utf-8")
