"""What one transformers version reads from serving checkpoints, as JSON.

Runs in-process under the suite's transformers 5 and as `python -m tests.ckpt_probe DIR...`
under a 4.x overlay (tests/overlays.py); tests/unit/test_checkpoint_compat.py compares the
two. Uses only APIs that exist from transformers 4.36 to 5.x.
"""

from __future__ import annotations

import json
import sys

SAMPLES = (
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café, déjà vu",
    "日本語のテキストと中文字符",
    "emoji 🙂👍🏽🇯🇵 done",
    "  two spaces\nand a newline\t tab",
    "<s> special </s> tokens <unk>",
    "don't , stop . ok ?",
    "a <tool> call",  # one token where the checkpoint adds it as a special token (last: past
)                     # the positions the logits read, as its id may be past the vocabulary)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "日本?"}]
PROMPT_TOKENS = 48  # enough positions for a wrong RoPE theta to change the logits


def _major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def rope_as_read(config) -> dict:
    """RoPE theta and type as this version reads them (4.x: as transformers-neuronx does)."""
    if _major() >= 5:
        rope = config.rope_parameters
        return {"theta": rope["rope_theta"], "type": rope.get("rope_type", "default")}
    # aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/llama/config.py:L43-L46
    scaling = getattr(config, "rope_scaling", None) or {}
    return {"theta": getattr(config, "rope_theta", 10000),
            "type": scaling.get("rope_type", scaling.get("type", "default"))}


def probe(path: str) -> dict:
    """Token ids, decoded text, chat rendering, RoPE, generation ids and logits of `path`."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(path)
    ids = [tok(s)["input_ids"] for s in SAMPLES]
    out = {
        "transformers": transformers.__version__,
        "ids": ids,
        "decoded": [tok.decode(i) for i in ids],
        "decoded_skip_special": [tok.decode(i, skip_special_tokens=True) for i in ids],
        "special_ids": [tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id],
        "chat": tok.apply_chat_template(CHAT, tokenize=False) if tok.chat_template else None,
        "rope": rope_as_read(AutoConfig.from_pretrained(path)),
    }
    gen = GenerationConfig.from_pretrained(path)
    out["generation_ids"] = [gen.bos_token_id, gen.eos_token_id, gen.pad_token_id]
    dtype_kw = "dtype" if _major() >= 5 else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(path, **{dtype_kw: torch.float32}).eval()
    rotary = next(m for m in model.modules() if isinstance(getattr(m, "inv_freq", None),
                                                             torch.Tensor))
    out["inv_freq"] = rotary.inv_freq.tolist()
    out["attention_scaling"] = float(getattr(rotary, "attention_scaling", 1.0))
    prompt = torch.tensor([sum(ids, [])[:PROMPT_TOKENS]])
    with torch.no_grad():
        out["logits"] = model(prompt).logits[0].tolist()
    return out


def probe_or_error(path: str) -> dict:
    try:
        return probe(path)
    except Exception as e:  # reported to the comparing test, which decides
        return {"error": f"{type(e).__name__}: {e}"}


if __name__ == "__main__":
    print(json.dumps({p: probe_or_error(p) for p in sys.argv[1:]}))
