"""Which files of a Hugging Face Hub download `prepare` reads, for each family's layout.

A `huggingface-cli download` of a model repository brings everything in it, and some
families publish two layouts side by side:
- Llama 3/3.1 (meta-llama): the transformers layout at the top, Meta's own under
  `original/` (consolidated.00.pth, params.json, a tiktoken tokenizer.model): the subfolder
  is never read.
- Qwen2.5 / Qwen3 (Qwen): the transformers layout only, with a BPE tokenizer as vocab.json,
  merges.txt and tokenizer.json (no tokenizer.model); the small sizes tie their embeddings,
  so their weights hold no lm_head.weight (transformers ties it again at load).
- Mistral-7B-Instruct-v0.3 (mistralai): the transformers layout (config.json,
  model-0000N-of-00003.safetensors and their index, tokenizer.json) beside Mistral's own
  (params.json, consolidated.safetensors, tokenizer.model.v3) in the same folder;
  Mixtral-8x7B-Instruct-v0.1 has consolidated.00.pt ... consolidated.07.pt beside its
  safetensors. The consolidated files hold the same weights under Mistral's names
  (layers.0.attention.wq.weight), so they are never read as shards; a download of the
  Mistral layout alone (what mistral-inference's instructions fetch) has no config.json,
  tokenizer.json or chat template, and is refused with the files to fetch instead.
"""

from __future__ import annotations

from pathlib import Path

from handlers.errors import Inf2ServeError

#: Mistral's own layout (mistral-inference): weights under its names, and its config
MISTRAL_NATIVE_WEIGHTS = ("consolidated.safetensors", "consolidated.*.safetensors",
                          "consolidated.*.pt", "consolidated.*.pth", "consolidated.pth")
MISTRAL_NATIVE_CONFIG = "params.json"
#: what to fetch instead: the transformers layout of the same repository
HF_LAYOUT_PATTERNS = ("config.json", "generation_config.json", "model*.safetensors*",
                      "tokenizer*", "special_tokens_map.json")


def is_native_weights(path: Path) -> bool:
    """A weights file of Mistral's own layout, never a transformers shard."""
    return any(path.match(pattern) for pattern in MISTRAL_NATIVE_WEIGHTS)


def transformers_shards(paths: list[Path]) -> list[Path]:
    """The weight files of the transformers layout among a folder's files."""
    return [p for p in paths if not is_native_weights(p)]


def check_layout(src: Path) -> None:
    """Refuse, with what to download, a folder holding only Mistral's own layout."""
    if (src / "config.json").is_file() or not (src / MISTRAL_NATIVE_CONFIG).is_file():
        return
    native = sorted(p.name for p in src.iterdir() if is_native_weights(p))
    if not native:
        return
    include = " ".join(f"'{p}'" for p in HF_LAYOUT_PATTERNS)
    raise Inf2ServeError(
        f"SRC {src}: Mistral's own layout ({MISTRAL_NATIVE_CONFIG}, {native[0]}), which "
        "transformers does not read (no config.json, tokenizer.json or chat template); "
        f"download the repository's transformers layout: huggingface-cli download REPO "
        f"--include {include} --local-dir {src}")
