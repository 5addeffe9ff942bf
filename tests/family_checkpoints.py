"""Tiny checkpoints of each model family, built with transformers itself (no download).

Each is the family's own transformers class from a small config with the family's
conventions (Qwen2: q/k/v bias and tied embeddings as in its small sizes; Qwen3: q/k norms
and a head_dim that is not hidden / heads; Mistral: an optional sliding window; Mixtral:
experts), random weights from a seed, saved as the hub does (transformers 5 writes
Mixtral's experts per expert on disk, as 4.x does). The tokenizer is the demo model's,
copied, so the vocabularies match and TorchServe can serve the result.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

#: the transformers config and model classes of each family
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
           "mistral": ("MistralConfig", "MistralForCausalLM"),
           "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
           "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def has_family(family: str) -> bool:
    """Whether this transformers has the family (Qwen3 came in 4.51; NxD Inference 0.8,
    which runs it, pins 4.57)."""
    import transformers

    return hasattr(transformers, CLASSES[family][1])


def family_config(family: str, vocab: int = 1024, **overrides: Any) -> dict[str, Any]:
    base = {"vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 2048, "initializer_range": 0.08, "bos_token_id": 1,
            "eos_token_id": 2, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
    extra = {"qwen2": {"tie_word_embeddings": True, "use_sliding_window": False},
             "qwen3": {"tie_word_embeddings": True, "head_dim": 32,
                       "use_sliding_window": False},
             "mistral": {"sliding_window": None},
             "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2,
                         "sliding_window": None},
             "llama": {}}[family]
    return {**base, **extra, **overrides}


def build_family_checkpoint(dest: Path, family: str, tokenizer_from: Path | None = None,
                            seed: int = 0, **overrides: Any) -> Path:
    """A tiny `family` checkpoint at `dest` (replaced), with the demo tokenizer's files
    from `tokenizer_from` when given."""
    import torch
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in CLASSES[family])
    config = config_cls(**family_config(family, **overrides))
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    model.save_pretrained(dest, safe_serialization=True)
    _legacy_keys(dest / "config.json")
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_from) / name).is_file():
                shutil.copy(Path(tokenizer_from) / name, dest / name)
    return dest


def _legacy_keys(path: Path) -> None:
    """config.json readable by transformers 4.x too (rope_theta top level), as
    archive_tools/checkpoint_compat.py writes the demo model's."""
    from archive_tools.checkpoint_compat import config_for_4x

    path.write_text(json.dumps(config_for_4x(json.loads(path.read_text())), indent=2))


def greedy_reference(checkpoint: Path, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of the checkpoint by plain transformers (full recompute, no cache)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint)).float().eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
