"""Output-side cost of stop strings per generated token: the automaton against the rule
it replaced (every prefix of every stop string tried at each token), in one process,
rounds alternating so that drift hits both alike. Medians of the rounds.

    python bench/stop_strings.py --out bench/results/stop_strings.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from handlers.engine.detokenize import StopMatcher, _automaton  # noqa: E402

CORPUS = Path(__file__).resolve().parents[1] / "archive_tools" / "data" / "corpus.txt"


class PrefixStopMatcher:
    """The rule before the automaton (the reference of this comparison)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops, self._held = stops, ""

    def feed(self, text: str) -> tuple[str, bool]:
        if not self._stops:
            return text, False
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[:min(hits)], True
        hold = max((k for s in self._stops for k in range(1, len(s)) if buf.endswith(s[:k])),
                   default=0)
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], False


def token_texts(n: int, rng: random.Random) -> list[str]:
    """Token-sized pieces of real text: words split into chunks of 1-6 characters."""
    words = CORPUS.read_text(encoding="utf-8").split()
    out: list[str] = []
    while len(out) < n:
        word = " " + rng.choice(words)
        while word and len(out) < n:
            k = rng.randint(1, 6)
            out.append(word[:k])
            word = word[k:]
    return out


def stop_sets(rng: random.Random) -> dict[str, tuple[str, ...]]:
    """The allowed worst case (8 x 256 characters, from the corpus so prefixes recur) and a
    common one; neither ever matches the stream (a match would end it)."""
    text = CORPUS.read_text(encoding="utf-8")
    long = []
    while len(long) < 8:
        start = rng.randrange(len(text) - 300)
        long.append(text[start:start + 255] + "\x00")  # never completes
    return {"8 x 256 chars": tuple(long), "1 x '\\n\\n'": ("\n\n",)}


def per_token_us(cls: type, stops: tuple[str, ...], texts: list[str]) -> float:
    matcher = cls(stops)
    start = time.perf_counter()
    for text in texts:
        matcher.feed(text)
    return (time.perf_counter() - start) / len(texts) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=Path("bench/results/stop_strings.json"))
    args = ap.parse_args()
    rng = random.Random(0)
    texts = token_texts(args.tokens, rng)
    results = {}
    for name, stops in stop_sets(rng).items():
        rounds = {"prefix rule (before)": [], "automaton (after)": []}
        for _ in range(args.rounds):  # alternating: A B A B ...
            rounds["prefix rule (before)"].append(per_token_us(PrefixStopMatcher, stops, texts))
            rounds["automaton (after)"].append(per_token_us(StopMatcher, stops, texts))
        builds = []
        for _ in range(args.rounds):
            _automaton.cache_clear()
            start = time.perf_counter()
            StopMatcher(stops)
            builds.append((time.perf_counter() - start) * 1e6)
        results[name] = {
            **{k: {"median_us_per_token": statistics.median(v), "rounds": v}
               for k, v in rounds.items()},
            "automaton build, us per distinct stop set (cached after)": statistics.median(builds),
        }
    report = {"tokens": args.tokens, "rounds": args.rounds, "python": platform.python_version(),
              "cpus": os.cpu_count(), "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# Stop strings: output-side cost per token", "",
             f"`python bench/stop_strings.py` ({args.tokens} token-sized pieces of "
             f"archive_tools/data/corpus.txt, {args.rounds} alternating rounds, medians; "
             f"Python {report['python']}, {report['cpus']} CPUs)", "",
             "| stop strings | prefix rule (before) | automaton (after) | automaton build |",
             "|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['prefix rule (before)']['median_us_per_token']:.2f} us "
                     f"| {r['automaton (after)']['median_us_per_token']:.2f} us | "
                     f"{r['automaton build, us per distinct stop set (cached after)']:.0f} us |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
