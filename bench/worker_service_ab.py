"""Paired A/B of `handler.worker_service` (torchserve vs inf2serve) on the synthetic device.

Both archives are served by one TorchServe; in each round every stream count runs both,
the order alternating between rounds, so machine drift hits both alike. Prints each
variant's median host efficiency and the per-round ratio inf2serve / torchserve.

Run: `.venv/bin/python bench/worker_service_ab.py --step-ms 10 --streams 1 8 32 --rounds 3`
(needs demo/tiny-llama: `make demo` or `inf2serve demo-model demo/tiny-llama`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from archive_tools.bench_stats import Scenario, host_efficiency  # noqa: E402
from archive_tools.loadgen import GenParams, run_scenario  # noqa: E402
from bench import device_bound  # noqa: E402
from tests.e2e.harness import build_store, running_server  # noqa: E402

VARIANTS = ("torchserve", "inf2serve")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--checkpoint", default=str(ROOT / "demo" / "tiny-llama"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="inf2serve-ab-"))
    ckpt = device_bound.synthetic_checkpoint(Path(args.checkpoint), work / "ckpt")
    specs = []
    for variant in VARIANTS:
        spec = device_bound.archive(args.step_ms, threads=1)
        spec.name = f"ws-{variant}"
        spec.handler["worker_service"] = variant
        specs.append(spec)
    store = build_store(work / "store", ckpt, specs)
    prompts = ["Once upon a time there was a little"] * 8
    params = GenParams(max_new_tokens=device_bound.NEW_TOKENS)
    eff: dict[tuple[str, int], list[float]] = {}
    with running_server(store, work / "run", [s.name for s in specs], test_jvm=False) as server:
        url = {s.name: f"{server.inference_url}/predictions/{s.name}" for s in specs}
        for s in specs:  # warm-up, JIT included
            run_scenario(url[s.name], server.inference_token,
                         Scenario("concurrency", max(args.streams), requests=3 * max(args.streams)),
                         prompts, params)
        for r in range(args.rounds):
            for c in args.streams:
                for s in (specs if r % 2 == 0 else specs[::-1]):
                    res = run_scenario(url[s.name], server.inference_token,
                                       Scenario("concurrency", c, requests=3 * c), prompts, params)
                    eff.setdefault((s.name, c), []).append(
                        host_efficiency(res.summary.output_tokens_per_s, c, args.step_ms))
    for c in args.streams:
        base, new = eff["ws-torchserve", c], eff["ws-inf2serve", c]
        ratios = [n / b for b, n in zip(base, new, strict=True)]
        print(f"{args.step_ms:g} ms, {c} streams: torchserve {statistics.median(base):.3f}, "
              f"inf2serve {statistics.median(new):.3f}, ratio per round "
              f"{' '.join(f'{x:.3f}' for x in ratios)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
