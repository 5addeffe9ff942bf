"""Grammar engines for structured outputs: llguidance, xgrammar and outlines-core, side by side.

What decides the choice (docs/structured_outputs.md): the time to compute one row's
next-token mask (host time every constrained step), the time to compile a schema (a
request's wait before its first token), the time to convert the tokenizer (once per model
load), and what each needs installed beside the Neuron SDKs' torch and transformers 4.x.

Tokenizers: no model may be downloaded here, so the two vocabularies are trained locally
once (the Python standard library's source as text; cached under bench/work/tokenizers,
about 12 minutes each on the 2-core host): 32,000 entries as Llama 2's (SentencePiece-style
BPE with byte fallback, "\u2581" for spaces) and 128,256 as Llama 3's (byte-level BPE with
Llama 3's split pattern). Their sizes and token shapes are those of the real ones; their
tokens are not.

Schemas: the corpus of tests/data/structured/schemas.json (real function-calling and
document schemas, each with its source). Per schema, one answer is produced by
llguidance with the stand-in model of tests/structured_walk.py (compact JSON, so every
engine accepts it), then replayed token by token through each engine: the time of each
step's mask fill for one row (into a preallocated int32 bitmask), not counting the token's
acceptance. Compile: a fresh compile of the schema (no cache) for the tokenizer.

Each cell runs `--rounds` rounds, engines in an order rotating from round to round; a
figure is the median over rounds of the round's median (mask: over all steps of all
schemas; compile: over schemas). xgrammar and outlines-core spend seconds on each compile
(a token-mask cache over the whole vocabulary, an index over it); they are timed on the
first `--xgrammar-schemas` and `--outlines-schemas` schemas of the corpus only, so compare
them with llguidance's figure on the same first schemas (the `first_n` columns).

Run: .venv/bin/pip install xgrammar outlines-core  (not project dependencies)
     .venv/bin/python bench/grammar_engines.py [--rounds 3] [--out bench/results]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from handlers.structured.compiler import JSON_OPTIONS, grammar_tokenizer  # noqa: E402
from handlers.structured.masks import RowGrammar, apply_bitmask, words  # noqa: E402
from tests.structured_walk import corpus, token_bias, walk  # noqa: E402

TOKENIZERS = ROOT / "bench" / "work" / "tokenizers"
VOCABS = (32000, 128256)
COMPACT = 1024  # rows allowing at most this many tokens are handed back compact
# Llama 3's pre-tokenizer split (tiktoken's cl100k pattern)
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
         r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def train(vocab: int, out: Path) -> None:
    """A locally trained tokenizer of Llama 2's (32,000) or Llama 3's (128,256) kind."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(os.__file__).parent
    files = sorted(glob.glob(str(stdlib / "**" / "*.py"), recursive=True))
    if vocab == 32000:
        tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
        special = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
        files = files[::3]
        trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=special,
                                      show_progress=False)
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((Path(f).read_text(errors="ignore") for f in files), trainer=trainer)
    if tok.get_vocab_size() != vocab:
        raise SystemExit(f"trained {tok.get_vocab_size()} tokens, wanted {vocab}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tok.save(str(tmp))
    tmp.rename(out)


def hf_tokenizer(vocab: int):
    from transformers import PreTrainedTokenizerFast

    path = TOKENIZERS / f"tok{vocab}.json"
    if not path.exists():
        print(f"training the {vocab}-entry tokenizer (once; cached at {path})", flush=True)
        train(vocab, path)
    special = ("<s>", "</s>") if vocab == 32000 else ("<|begin_of_text|>", "<|end_of_text|>")
    return PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token=special[0],
                                   eos_token=special[1])


# -- the engines -----------------------------------------------------------------------------
class LLGuidance:
    name = "llguidance"

    def __init__(self, hf, vocab):
        import llguidance

        self.llg = llguidance
        self.vocab = vocab
        self.tokenizer = grammar_tokenizer(hf, vocab, [hf.eos_token_id])
        self.mask = np.full((1, words(vocab)), -1, dtype=np.int32)

    def compile(self, schema):
        text = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        m = self.llg.LLMatcher(self.tokenizer, text, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def replay(self, m, tokens):
        from llguidance.numpy import fill_next_token_bitmask

        times = []
        for t in tokens:
            s = time.perf_counter()
            fill_next_token_bitmask(m, self.mask)
            times.append(time.perf_counter() - s)
            if not m.consume_token(t):
                raise ValueError("refused")
        return times


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf, vocab):
        import xgrammar

        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        self.mask = xgrammar.allocate_token_bitmask(1, vocab)

    def compile(self, schema):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        # JSON Schema's own semantics (strict_mode=False: unlisted properties allowed, as
        # llguidance reads the schema) and compact JSON, as the replayed answers are written
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                separators=(",", ":"), strict_mode=False)
        return self.xgr.GrammarMatcher(compiled)

    def replay(self, m, tokens):
        times = []
        for t in tokens:
            s = time.perf_counter()
            m.fill_next_token_bitmask(self.mask, 0)
            times.append(time.perf_counter() - s)
            if not m.accept_token(t):
                raise ValueError("refused")
        return times


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, hf, vocab, ll_tokenizer):
        import outlines_core

        self.oc = outlines_core
        eos = hf.eos_token_id
        pieces: dict[bytes, list[int]] = {}
        for i in range(len(hf)):
            if i == eos or ll_tokenizer.is_special_token(i):
                continue
            piece = ll_tokenizer.decode_bytes([i])
            if piece:
                pieces.setdefault(piece, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, pieces)
        self.mask = np.zeros(words(vocab), dtype=np.int32)

    def compile(self, schema):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), "")
        return self.oc.Guide(self.oc.Index(regex, self.vocabulary))

    def replay(self, guide, tokens):
        times = []
        for t in tokens:
            s = time.perf_counter()
            guide.write_mask_into(self.mask.ctypes.data, self.mask.size, 4)
            times.append(time.perf_counter() - s)
            guide.advance(t, return_tokens=False)
        return times


def make_engines(hf, vocab, want):
    out, notes = [], {}
    ll = LLGuidance(hf, vocab)
    for cls in (LLGuidance, XGrammar, OutlinesCore):
        if cls.name not in want:
            continue
        start = time.perf_counter()
        try:
            engine = (ll if cls is LLGuidance else
                      cls(hf, vocab, ll.tokenizer) if cls is OutlinesCore else cls(hf, vocab))
        except ImportError as exc:
            notes[cls.name] = f"not installed ({exc})"
            continue
        engine.setup_s = time.perf_counter() - start if cls is not LLGuidance else None
        out.append(engine)
    return ll, out, notes


def answers(ll: LLGuidance, schemas, vocab, eos) -> list[list[int] | None]:
    """One finished answer per schema (None where none finished), by the stand-in model."""
    from handlers.structured.masks import MaskBatch

    masks, bias = MaskBatch(1, vocab), token_bias(ll.tokenizer, vocab)
    out = []
    for i, e in enumerate(schemas):
        tokens, done = walk(RowGrammar(ll.compile(e["schema"])), masks, bias, [eos],
                            np.random.default_rng(i), max_tokens=1500)
        out.append(tokens if done else None)
    return out


def plain_apply(logits: np.ndarray, bitmask: np.ndarray, rows: int) -> None:
    """The usual bitmask apply, for reference: every row unpacked, -inf written across."""
    keep = np.unpackbits(bitmask[:rows].view(np.uint8), axis=1,
                         bitorder="little")[:, :logits.shape[1]]
    np.copyto(logits, -np.inf, where=keep == 0)


def batch_cell(ll: LLGuidance, schema, tokens, vocab, rows, rounds):
    """One schema's answer replayed on `rows` rows at once, every row constrained: the
    fill of all rows' masks (on this thread, and through llguidance's executor of 2
    threads) and the apply on [rows, vocab] float32 logits (`apply_bitmask` with rows of
    at most COMPACT allowed tokens compact, and the plain full-width apply): ms per step,
    the median over steps, then over rounds."""
    from handlers.structured.masks import MaskBatch

    seq, par = MaskBatch(rows, vocab), MaskBatch(rows, vocab, threads=2)
    logits = np.random.default_rng(0).standard_normal((rows, vocab)).astype(np.float32)
    per_round: dict[str, list[float]] = {k: [] for k in ("fill", "fill_2_threads", "apply",
                                                         "apply_plain")}
    for r in range(rounds):
        grammars = [RowGrammar(ll.compile(schema)) for _ in range(rows)]
        steps: dict[str, list[float]] = {k: [] for k in per_round}
        for t in tokens:
            for name, masks in (("fill", seq), ("fill_2_threads", par))[::1 if r % 2 else -1]:
                s = time.perf_counter()
                masks.fill(list(enumerate(grammars)))
                steps[name].append(time.perf_counter() - s)
            for name in ("apply", "apply_plain")[::1 if r % 2 else -1]:
                work = logits.copy()
                s = time.perf_counter()
                if name == "apply":
                    apply_bitmask(work, seq.bitmask, range(rows), compact_limit=COMPACT)
                else:
                    plain_apply(work, seq.bitmask, rows)
                steps[name].append(time.perf_counter() - s)
            for g in grammars:
                g.accept([t])
        for k, v in steps.items():
            per_round[k].append(statistics.median(v))
    out = {"rows": rows, "steps": len(tokens)}
    for k, v in per_round.items():
        out[f"{k}_ms"] = round(statistics.median(v) * 1e3, 3)
        out[f"{k}_ms_rounds"] = [round(x * 1e3, 3) for x in v]
    return out


def run_vocab(vocab, schemas, rounds, want, limits):
    hf = hf_tokenizer(vocab)
    start = time.perf_counter()
    ll, engines, notes = make_engines(hf, vocab, want)
    ll_setup = time.perf_counter() - start
    for e in engines:
        if e.name == "llguidance":
            e.setup_s = ll_setup
    seqs = answers(ll, schemas, vocab, hf.eos_token_id)
    cells = {}
    for e in engines:
        cells[e.name] = {"tokenizer_s": round(e.setup_s, 2), "compile_ms_rounds": [],
                         "mask_us_rounds": [], "mask_p99_us_rounds": [], "failed": {},
                         "first_n": {}}
    firsts = sorted({n for n in limits.values() if n < len(schemas)})
    for r in range(rounds):
        order = engines[r % len(engines):] + engines[:r % len(engines)]
        for e in order:
            compile_t, mask_t, until = [], [], []  # until[i]: steps after schema i
            for i, (s, toks) in enumerate(zip(schemas, seqs, strict=True)):
                if i >= limits.get(e.name, len(schemas)):
                    break
                try:
                    t0 = time.perf_counter()
                    m = e.compile(s["schema"])
                    compile_t.append(time.perf_counter() - t0)
                    if toks:
                        mask_t.extend(e.replay(m, toks))
                except Exception as exc:  # an engine that cannot take a schema: recorded
                    cells[e.name]["failed"][s["id"]] = str(exc).splitlines()[0][:120]
                until.append((len(compile_t), len(mask_t)))
            c = cells[e.name]
            for n in firsts:  # the same first schemas as a slower engine's
                if n <= len(until):
                    nc, nm = until[n - 1]
                    c["first_n"].setdefault(n, {"compile_ms_rounds": [], "mask_us_rounds": []})
                    c["first_n"][n]["compile_ms_rounds"].append(
                        round(statistics.median(compile_t[:nc]) * 1e3, 3))
                    c["first_n"][n]["mask_us_rounds"].append(
                        round(statistics.median(mask_t[:nm]) * 1e6, 1))
            c["compile_ms_rounds"].append(round(statistics.median(compile_t) * 1e3, 3))
            c["mask_us_rounds"].append(round(statistics.median(mask_t) * 1e6, 1))
            c["mask_p99_us_rounds"].append(round(float(np.percentile(mask_t, 99)) * 1e6, 1))
            c["schemas"] = len(compile_t)
            c["steps"] = len(mask_t)
        print(f"vocab {vocab} round {r + 1}: " + ", ".join(
            f"{n}: compile {c['compile_ms_rounds'][-1]} ms, mask {c['mask_us_rounds'][-1]} us"
            for n, c in cells.items()), flush=True)
    for c in cells.values():
        c["compile_ms"] = statistics.median(c["compile_ms_rounds"])
        c["mask_us"] = statistics.median(c["mask_us_rounds"])
        c["mask_p99_us"] = statistics.median(c["mask_p99_us_rounds"])
        for f in c["first_n"].values():
            f["compile_ms"] = statistics.median(f["compile_ms_rounds"])
            f["mask_us"] = statistics.median(f["mask_us_rounds"])
    nested = next(i for i, s in enumerate(schemas) if s["id"] == "openai-cookbook/math_reasoning")
    batch = [batch_cell(ll, schemas[nested]["schema"], seqs[nested], vocab, rows, rounds)
             for rows in (8, 32)] if seqs[nested] else []
    return {"vocab": vocab, "engines": cells, "notes": notes, "batched_llguidance": batch,
            "answers_finished": sum(1 for s in seqs if s), "answer_tokens": sum(
                len(s) for s in seqs if s)}


def markdown(doc) -> str:
    m = doc["meta"]
    lines = [f"# Grammar engines: mask and compile time ({m['host']}, {m['created']})", "",
             f"{m['schemas']} schemas of tests/data/structured/schemas.json (one in "
             f"{m['every']}, and the nested math_reasoning); locally trained "
             "tokenizers of Llama 2's and Llama 3's sizes (bench/grammar_engines.py says how "
             f"the answers are made and replayed). Median of {m['rounds']} rounds; mask = one "
             "row's next-token bitmask, per step of the replayed answers; compile = one schema, "
             "fresh, median over schemas. Versions: " + ", ".join(
                 f"{k} {v}" for k, v in m["versions"].items()) +
             f". Load average before {m['loadavg_before']}, after {m['loadavg_after']} "
             "(a shared 2-core host: absolute figures are loose, the ratios within a round hold).",
             "", "| vocab | engine | tokenizer s | compile ms (median) | mask us/token (median) "
             "| mask us p99 | schemas | steps | failed |", "|---|---|---|---|---|---|---|---|---|"]
    for v in doc["vocabs"]:
        for name, c in v["engines"].items():
            lines.append(f"| {v['vocab']:,} | {name} | {c['tokenizer_s']} | {c['compile_ms']} | "
                         f"{c['mask_us']} | {c['mask_p99_us']} | {c['schemas']} | {c['steps']} "
                         f"| {len(c['failed'])} |")
        for name, note in v["notes"].items():
            lines.append(f"| {v['vocab']:,} | {name} | {note} | | | | | | |")
    lines += ["", "On the same first schemas (each engine's figure over the first n schemas of "
              "the corpus, same rounds):", "",
              "| vocab | first n | engine | compile ms | mask us/token |", "|---|---|---|---|---|"]
    for v in doc["vocabs"]:
        for name, c in v["engines"].items():
            for n, f in sorted(c["first_n"].items(), key=lambda kv: int(kv[0])):
                lines.append(f"| {v['vocab']:,} | {n} | {name} | {f['compile_ms']} | "
                             f"{f['mask_us']} |")
    lines += ["", "llguidance batched: the nested math_reasoning schema's answer replayed on every "
              "row at once, ms per step. fill: `MaskBatch.fill` of all rows on one thread "
              "(what runs while the device computes the step); with 2 threads: llguidance's "
              "executor. apply: `apply_bitmask` on [rows, vocab] float32 logits (rows "
              f"allowing at most {COMPACT} tokens gathered compact, the rest masked whole), "
              "beside the plain full-width apply (what lengthens the step).", "",
              "| vocab | rows | fill ms | fill ms, 2 threads | apply ms | plain apply ms |",
              "|---|---|---|---|---|---|"]
    for v in doc["vocabs"]:
        for b in v["batched_llguidance"]:
            lines.append(f"| {v['vocab']:,} | {b['rows']} | {b['fill_ms']} | "
                         f"{b['fill_2_threads_ms']} | {b['apply_ms']} | {b['apply_plain_ms']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--engines", default="llguidance,xgrammar,outlines-core")
    ap.add_argument("--outlines-schemas", type=int, default=4)
    ap.add_argument("--xgrammar-schemas", type=int, default=6)
    ap.add_argument("--vocabs", default=",".join(map(str, VOCABS)))
    ap.add_argument("--limit", type=int, default=0, help="the first N schemas only (smoke)")
    ap.add_argument("--every", type=int, default=1,
                    help="every Nth schema of the corpus (and math_reasoning, the nested one)")
    args = ap.parse_args()
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for pkg in ("llguidance", "xgrammar", "outlines-core", "transformers", "tokenizers"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    schemas = corpus()["schemas"]
    if args.every > 1:
        schemas = [s for i, s in enumerate(schemas)
                   if i % args.every == 0 or s["id"] == "openai-cookbook/math_reasoning"]
    if args.limit:
        keep = schemas[:args.limit]
        schemas = keep + [s for s in schemas[args.limit:]
                          if s["id"] == "openai-cookbook/math_reasoning"]
    meta = {"created": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(),
            "cpus": os.cpu_count(), "rounds": args.rounds, "schemas": len(schemas),
            "python": platform.python_version(), "versions": versions,
            "loadavg_before": [round(x, 2) for x in os.getloadavg()], "every": args.every}
    want = set(args.engines.split(","))
    limits = {"outlines-core": args.outlines_schemas, "xgrammar": args.xgrammar_schemas}
    meta["schemas_per_engine"] = {k: min(v, len(schemas)) for k, v in limits.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta, "vocabs": []}
    for v in args.vocabs.split(","):  # written after each vocabulary: a long run keeps its half
        doc["vocabs"].append(run_vocab(int(v), schemas, args.rounds, want, limits))
        meta["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        (out / "grammar_engines.json").write_text(json.dumps(doc, indent=1) + "\n")
        (out / "grammar_engines.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
