"""`inf2serve demo-model`: a random-weight Llama checkpoint and tokenizer, built locally.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on a corpus
shipped with the package plus seeded pseudo-words (so `bench` reaches its 8000
entries), and the weights are drawn from a seeded generator. The same seed gives
the same files, which transformers 4.36+ and 5.x read the same way
(archive_tools/checkpoint_compat.py).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from archive_tools.checkpoint_compat import make_compatible
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
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
LLAMA2_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}"
    "{% if loop.first and system %}{{ bos_token + '[INST] <<SYS>>\\n' + system + "
    "'\\n<</SYS>>\\n\\n' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)


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


def build_tokenizer(size: DemoSize, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size.vocab, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(seed, pseudo_words=size.vocab * 12), trainer=trainer)
    if tok.get_vocab_size() != size.vocab:
        raise Inf2ServeError(f"demo tokenizer has {tok.get_vocab_size()} entries, "
                             f"expected {size.vocab}; the corpus is too small")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=size.max_positions,
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = LLAMA2_CHAT_TEMPLATE
    return fast


def build_demo_model(out: Path, size_name: str = "tiny", seed: int = 0) -> Path:
    """Write config, safetensors weights and tokenizer files to `out` (atomically)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if size_name not in SIZES:
        raise Inf2ServeError(f"--size {size_name!r}: choose one of {', '.join(SIZES)}")
    size = SIZES[size_name]
    tokenizer = build_tokenizer(size, seed)
    config = LlamaConfig(
        vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads, max_position_embeddings=size.max_positions,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False, initializer_range=0.08 if size_name == "tiny" else 0.02,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
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


def holds_demo_model(out: Path, size_name: str) -> bool:
    """True if `out` already holds a demo model of this size (config, weights, tokenizer)."""
    try:
        cfg = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return False
    size = SIZES[size_name]
    want = {"hidden_size": size.hidden, "num_hidden_layers": size.layers,
            "num_attention_heads": size.heads, "num_key_value_heads": size.kv_heads,
            "intermediate_size": size.intermediate, "vocab_size": size.vocab}
    return (all(cfg.get(k) == v for k, v in want.items())
            and (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file())


def _run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.force:
        if args.size in SIZES and holds_demo_model(out, args.size):  # e.g. after `make demo`
            print(f"{out} already holds the {args.size} demo model; kept (--force rebuilds it)")
            return 0
        raise Inf2ServeError(f"{out} exists and is not empty; pass --force to replace it")
    build_demo_model(out, args.size, args.seed)
    n = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {args.size} demo model to {out} ({n / 1e6:.1f} MB)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo-model",
        help="write a random-weight Llama checkpoint and tokenizer (no download)",
        description="Write a random-weight Llama checkpoint (safetensors) and a byte-level BPE "
        "tokenizer.\n\nexamples:\n  inf2serve demo-model demo/tiny-llama\n"
        "  inf2serve demo-model bench/work/bench-llama --size bench",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("out", help="output directory")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="replace an existing directory")
    p.set_defaults(func=_run)
