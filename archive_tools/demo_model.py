"""`inf2serve demo-model`: a random-weight checkpoint and tokenizer, built locally.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on a corpus
shipped with the package plus seeded pseudo-words (so `bench` reaches its 8000
entries), and the weights are drawn from a seeded generator. The same seed gives
the same files, which transformers 4.36+ and 5.x read the same way
(archive_tools/checkpoint_compat.py). `--arch` picks the family (Llama by default;
Qwen2, Qwen3, Mistral, Mixtral: archive_tools/demo_families.py), each with its
config conventions, special tokens and real chat template.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from archive_tools.checkpoint_compat import make_compatible
from archive_tools.demo_families import FAMILIES, Family
from handlers.errors import Inf2ServeError


@dataclass(frozen=True)
class DemoSize:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int


SIZES = {
    # under 1M parameters: for tests
    "tiny": DemoSize(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=172, vocab=1024,
                     max_positions=2048),
    # about 88M parameters: for benchmarks
    "bench": DemoSize(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048, vocab=8000,
                      max_positions=2048),
}


def _corpus(seed: int, pseudo_words: int) -> list[str]:
    text = resources.files("archive_tools").joinpath("data/corpus.txt").read_text("utf-8")
    lines = text.splitlines()
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
             for _ in range(pseudo_words)]
    for i in range(0, len(words), 12):
        lines.append(" ".join(words[i:i + 12]) + ".")
    return lines * 2


def build_tokenizer(size: DemoSize, seed: int, family: Family | None = None):
    """A byte-level BPE trained on the shipped corpus, with the family's special tokens (ids
    0.. in order), its added text tokens (Qwen's <tool_call>, <think>: special=False, so they
    decode as text, as in Qwen's tokenizer_config.json) and its chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    family = family or FAMILIES["llama"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size.vocab - len(family.added), special_tokens=list(family.special),
        show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(seed, pseudo_words=size.vocab * 12), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added])
    if tok.get_vocab_size() != size.vocab:
        raise Inf2ServeError(f"demo tokenizer has {tok.get_vocab_size()} entries, "
                             f"expected {size.vocab}; the corpus is too small")
    named = {k: v for k, v in (("bos_token", family.bos), ("eos_token", family.eos),
                               ("unk_token", family.unk), ("pad_token", family.pad)) if v}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=size.max_positions,
                                   clean_up_tokenization_spaces=False, **named)
    fast.chat_template = family.chat_template()
    return fast


def build_demo_model(out: Path, size_name: str = "tiny", seed: int = 0,
                     arch: str = "llama") -> Path:
    """Write config, safetensors weights and tokenizer files to `out` (atomically)."""
    import torch
    from transformers import AutoModelForCausalLM

    if size_name not in SIZES:
        raise Inf2ServeError(f"--size {size_name!r}: choose one of {', '.join(SIZES)}")
    if arch not in FAMILIES:
        raise Inf2ServeError(f"--arch {arch!r}: choose one of {', '.join(FAMILIES)}")
    size, family = SIZES[size_name], FAMILIES[arch]
    tokenizer = build_tokenizer(size, seed, family)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in family.special + family.added}
    config = family.build_config(size, ids, size_name == "tiny")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    stop = [ids[t] for t in family.stop_tokens]
    model.generation_config.eos_token_id = stop[0] if len(stop) == 1 else stop
    if family.pad:
        model.generation_config.pad_token_id = ids[family.pad]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        # the template inline in tokenizer_config.json: transformers < 4.47 reads only that
        tokenizer.save_pretrained(tmp, save_jinja_files=False)
        make_compatible(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.chmod(0o755)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def holds_demo_model(out: Path, size_name: str, arch: str = "llama") -> bool:
    """True if `out` already holds a demo model of this size and family (config, weights,
    tokenizer)."""
    try:
        cfg = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return False
    size, family = SIZES[size_name], FAMILIES[arch]
    # what this family's config.json says (the ids do not matter here)
    built = family.build_config(size, defaultdict(int), size_name == "tiny").to_dict()
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "intermediate_size", "vocab_size", "sliding_window")
    return (all(cfg.get(k) == built.get(k) for k in keys)
            and (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file())


def _run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.force:
        if (args.size in SIZES and args.arch in FAMILIES
                and holds_demo_model(out, args.size, args.arch)):  # e.g. after `make demo`
            print(f"{out} already holds the {args.size} {args.arch} demo model; kept (--force "
                  "rebuilds it)")
            return 0
        raise Inf2ServeError(f"{out} exists and is not empty; pass --force to replace it")
    build_demo_model(out, args.size, args.seed, args.arch)
    n = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {args.size} {args.arch} demo model to {out} ({n / 1e6:.1f} MB)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo-model",
        help="write a random-weight checkpoint and tokenizer of a model family (no download)",
        description="Write a random-weight checkpoint (safetensors) and a byte-level BPE "
        "tokenizer with the family's special tokens and real chat template.\n\nexamples:\n"
        "  inf2serve demo-model demo/tiny-llama\n"
        "  inf2serve demo-model demo/tiny-qwen3 --arch qwen3\n"
        "  inf2serve demo-model bench/work/bench-llama --size bench",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("out", help="output directory")
    p.add_argument("--arch", choices=list(FAMILIES), default="llama",
                   help="model family (default: llama)")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny",
                   help="; ".join(f"{name}: {s.layers} layers of {s.hidden}, {s.vocab} tokens"
                                  for name, s in SIZES.items()) + " (default tiny)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random weights (default 0): the same seed, the same model")
    p.add_argument("--force", action="store_true", help="replace an existing directory")
    p.set_defaults(func=_run)
