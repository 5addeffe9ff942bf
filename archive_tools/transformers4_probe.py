"""`python -m archive_tools.transformers4_probe CKPT`: load as a worker does, print JSON.

Run by archive_tools/transformers4.py under a transformers 4.x overlay (first on
PYTHONPATH): AutoConfig and AutoTokenizer as the worker calls them, and the chat template
compiled, with only APIs that exist from 4.36 to 5.x. The last stdout line is
{"transformers": VERSION}, {"transformers": VERSION, "unknown": MODEL_TYPE} when that
transformers predates the checkpoint's family (Qwen2 came in 4.37, Qwen3 in 4.51: no SDK
shipping it serves the family, so there is nothing to load), or {"error": "Type: first line"}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def probe(path: str) -> dict:
    import transformers
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    if model_type not in CONFIG_MAPPING_NAMES:
        return {"transformers": transformers.__version__, "unknown": model_type}
    AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if getattr(tokenizer, "chat_template", None):
        tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False,
                                      add_generation_prompt=True)
    return {"transformers": transformers.__version__}


def main(argv: list[str]) -> int:
    try:
        out = probe(argv[0])
    except Exception as exc:  # reported to the caller, which refuses with it
        lines = str(exc).strip().splitlines()
        out = {"error": f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
