"""`inf2serve bench URL`: load-test a streaming TorchServe endpoint and write a report.

Thin wiring over `loadgen` (sending, timing), `bench_stats` (numbers) and
`bench_report` (files); `make bench` calls those directly to compare setups.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from archive_tools import bench_report, loadgen
from archive_tools.bench_stats import BenchError, Scenario, ScenarioResult, host_efficiency

DEFAULT_REQUESTS = 32


def _csv(kind: Callable[[str], float]) -> Callable[[str], list]:
    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of "
                                             "numbers, e.g. 1,5,10") from None
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: give one or more numbers > 0")
        return list(dict.fromkeys(values))  # a level given twice is one scenario, one row
    return parse


def build_scenarios(mode: str, concurrency: list[int], rates: list[float],
                    requests: int | None, duration_s: float | None) -> list[Scenario]:
    """The scenarios of a --mode, in run order: sync, then the concurrency, then the rate sweep."""
    bound = {"requests": requests, "duration_s": duration_s}
    out = []
    if mode in ("sync", "all"):
        out.append(Scenario("sync", 1, **bound))
    if mode in ("concurrency", "all"):
        out += [Scenario("concurrency", c, **bound) for c in concurrency]
    if mode in ("rate", "all"):
        out += [Scenario("rate", r, **bound) for r in rates]
    return out


#: TorchServe 0.12's answer to a missing, wrong or expired token: 400, not 401
#: (TokenAuthorizationHandler.java: InvalidKeyException)
BAD_TOKEN = "InvalidKeyException"


def served(run_dir: Path) -> dict | None:
    """RUN_DIR/server.json of a running `inf2serve serve` (its URLs and models), or None."""
    try:
        info = json.loads((run_dir / "server.json").read_text("utf-8"))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and isinstance(info.get("models"), list) else None


def model_urls(run_dir: Path) -> list[str]:
    info = served(run_dir)
    return [f"{info['inference_url']}/predictions/{m}" for m in info["models"]] if info else []


def bench_url(url: str, run_dir: Path) -> tuple[str, str | None]:
    """The inference URL to stream from, and a note when it is not `url`: `serve` prints
    OpenAI base URLs too, and bench speaks the native NDJSON stream. A model's base URL
    (.../predictions/NAME/VERSION/v1) becomes its versioned inference URL; the one base URL
    of every model becomes its model's when the server of `run_dir` serves one."""
    url = loadgen.check_url(url)
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    if not path.endswith("/v1"):
        return url, None
    m = re.fullmatch(r"(.*/predictions/[^/]+(?:/[^/]+)?)/v1", path)
    if m:
        native = urlunsplit(parts._replace(path=m.group(1)))
        return native, f"{url} is an OpenAI base URL; benching its model's inference URL {native}"
    urls = model_urls(run_dir)
    if len(urls) == 1:
        return urls[0], (f"{url} is the OpenAI base URL of every model; benching the one "
                         f"served model's inference URL {urls[0]}")
    listed = ", ".join(urls) or "http://HOST:PORT/predictions/NAME, which `serve` printed"
    raise BenchError(f"URL {url} is an OpenAI base URL; bench streams from one model's "
                     f"inference URL: {listed}")


def bench_token(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """The inference token, and where it came from when not given: like the chat page, the
    key file of the `inf2serve serve` of --run-dir."""
    if args.token or args.token_file:
        return loadgen.read_token(args.token, args.token_file), None
    key_file = Path(args.run_dir) / "key_file.json"
    if key_file.is_file():
        return loadgen.read_token(None, key_file), f"token from {key_file}"
    return None, None


def _fixes(run_dir: Path) -> dict[str, str]:
    urls = model_urls(run_dir)
    models = (f"the server of {run_dir} serves {', '.join(urls)}" if urls else
              "`inf2serve serve` printed each model's inference URL")
    return {"connect": "start the server (inf2serve serve) or fix the host/port",
            "401": "pass --token-file path/to/key_file.json (or --token)",
            "403": "pass the inference key, not the management key",
            "404": f"check the model name in the URL: {models}",
            BAD_TOKEN: ("TorchServe refused the token (missing, wrong or expired): pass "
                        "--run-dir of `inf2serve serve` or --token-file RUN_DIR/key_file.json; "
                        "an expired one is renewed by `inf2serve token`")}


def check_reachable(result: ScenarioResult, url: str, run_dir: Path = Path(".serve")) -> None:
    """Stop after the first scenario when nothing worked for a reason no retry will fix."""
    s = result.summary
    if s.ok or not s.requests:
        return
    kinds = set(s.errors_by_kind)
    fixes = _fixes(run_dir)
    if len(kinds) == 1:
        kind = kinds.pop()
        example = next(r.error for r in result.records if r.error)
        fix = fixes[BAD_TOKEN] if kind == "400" and BAD_TOKEN in example else fixes.get(kind)
        if fix is not None:
            raise BenchError(f"every request to {url} failed with {kind} ({example}); {fix}")


def efficiency_by_level(results: list[ScenarioResult], step_ms: float) -> dict[str, float]:
    """Host efficiency of each concurrency scenario against a device of `step_ms` decode
    steps (served tokens/s / (streams / step)), keyed by scenario name ("c=8")."""
    return {r.scenario.name: round(host_efficiency(r.summary.output_tokens_per_s,
                                                   int(r.scenario.level), step_ms), 3)
            for r in results if r.scenario.mode == "concurrency"}


def report_dir(out: Path, append: bool, now: datetime | None = None) -> Path:
    """Where this run's report goes: OUT, or a new timestamped folder inside OUT when OUT
    already holds a report (e.g. the committed bench/results) and --append was not given."""
    if append or not (out / bench_report.JSON_NAME).exists():
        return out
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    return out / stamp


def short_waves(scenarios: list[Scenario]) -> list[int]:
    """Concurrency levels that a --requests bound keeps from ever being reached."""
    return [int(s.level) for s in scenarios
            if s.mode == "concurrency" and s.requests is not None and s.requests < s.level]


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if not args.debug:  # httpx logs every request at INFO, which would bury the progress bar
        logging.getLogger("httpx").setLevel(logging.WARNING)
    url, url_note = bench_url(args.url, Path(args.run_dir))
    token, token_note = bench_token(args)
    if not args.timeout > 0:
        raise BenchError(f"--timeout {args.timeout} must be > 0 seconds")
    if args.device_step_ms is not None and not args.device_step_ms > 0:
        raise BenchError(f"--device-step-ms {args.device_step_ms} must be > 0")
    if args.duration is not None:
        requests = None
    else:
        requests = DEFAULT_REQUESTS if args.requests is None else args.requests
    scenarios = build_scenarios(args.mode, args.concurrency, args.rates, requests, args.duration)
    console = Console()
    for note in (url_note, token_note):
        if note:
            console.print(note, highlight=False, soft_wrap=True)
    if short := short_waves(scenarios):
        console.print(f"[yellow]warning:[/] --requests {requests} is below concurrency "
                      f"{', '.join(map(str, short))}: those scenarios never have that many "
                      f"requests in flight; pass --requests {max(short)} or more (a multiple of "
                      "each level keeps every wave full)")
    out = report_dir(args.out, args.append)
    if out != args.out:
        console.print(f"{args.out} holds a report already; this run writes to {out} "
                      "(--append adds to that one)")
    if args.prompts_file:
        prompts = loadgen.load_prompts(args.prompts_file)
    else:
        counter = loadgen.tokenizer_counter(args.tokenizer) if args.tokenizer else None
        prompts = loadgen.build_prompts(requests or 256, args.prompt_tokens, args.seed, counter)
    params = loadgen.GenParams(args.max_new_tokens, args.min_new_tokens, args.temperature,
                               args.seed)
    results: bench_report.Results = {}
    families: dict[str, str] = {}
    if args.append and (out / bench_report.JSON_NAME).exists():
        results, _, families = bench_report.read_report(out / bench_report.JSON_NAME)
    results[args.label] = []
    # a synthetic device's milliseconds and a real model's seconds get separate figures
    families[args.label] = "device" if args.device_step_ms is not None else "served"

    columns = (TextColumn("{task.description:<14}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[errors]} errors"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        for scenario in scenarios:
            task = progress.add_task(scenario.name, errors=0,
                                     total=loadgen.expected_requests(scenario, args.seed))
            errors = 0

            def on_record(rec, task=task) -> None:
                nonlocal errors
                errors += not rec.ok
                progress.update(task, advance=1, errors=errors)

            result = loadgen.run_scenario(
                url, token, scenario, prompts, params, label=args.label, timeout_s=args.timeout,
                price_per_hour=args.price_per_hour, on_record=on_record)
            progress.update(task, total=len(result.records), completed=len(result.records))
            if not results[args.label]:
                check_reachable(result, url, Path(args.run_dir))
            results[args.label].append(result)

    meta = {"url": url, "label": args.label, "mode": args.mode, "prompt_tokens":
            None if args.prompts_file else args.prompt_tokens, "prompts_file": args.prompts_file,
            "tokenizer": str(args.tokenizer) if args.tokenizer else None,
            "max_new_tokens": args.max_new_tokens, "min_new_tokens": args.min_new_tokens,
            "temperature": args.temperature, "seed": args.seed,
            "price_per_hour": args.price_per_hour, "timeout_s": args.timeout}
    efficiency = {}
    if args.device_step_ms is not None:
        efficiency = efficiency_by_level(results[args.label], args.device_step_ms)
        meta.update(device_step_ms=args.device_step_ms, host_efficiency=efficiency)
    paths = bench_report.write_report(results, out, meta, families)
    bench_report.print_summary(results, console)
    for name, value in efficiency.items():
        console.print(f"host efficiency {name}: {value:.3f} (served tokens/s / (streams / "
                      f"{args.device_step_ms:g} ms step))")
    console.print(f"wrote {', '.join(str(p) for p in paths)}")
    check_any_ok(results[args.label], url)
    return 0


def check_any_ok(results: list[ScenarioResult], url: str) -> None:
    """A run in which no request succeeded measured nothing: an error, not exit 0."""
    if any(r.summary.ok for r in results):
        return
    kinds: dict[str, int] = {}
    for r in results:
        for kind, n in r.summary.errors_by_kind.items():
            kinds[kind] = kinds.get(kind, 0) + n
    example = next((rec.error for r in results for rec in r.records if rec.error), "")
    counts = ", ".join(f"{n} x {kind}" for kind, n in kinds.items())
    raise BenchError(f"no request to {url} succeeded ({counts}; e.g. {example}); the report "
                     "above measures only failures")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="load-test a streaming endpoint: TTFT, ITL, E2E, throughput, cost",
        description="Load-test a TorchServe streaming endpoint (NDJSON) and write to --out: "
        "bench.json (per-scenario summaries: percentiles, throughput, counts), bench.md, "
        "raw/records.json (every request's record) and PNG plots, one set per family (runs "
        "with --device-step-ms are 'device', others 'served').\n\nmodes: sync (one at a "
        "time), concurrency "
        "(closed loop, N in flight), rate (open loop, Poisson arrivals), all.\n\nexamples:\n"
        "  inf2serve bench http://127.0.0.1:8080/predictions/llama --token-file key_file.json\n"
        "  inf2serve bench URL --mode concurrency --concurrency 1,4,16 --requests 64\n"
        "  inf2serve bench URL --mode rate --rates 0.5,1,2 --duration 60 "
        "--price-per-hour 0.76 --label inf2-continuous --out bench/results --append\n"
        "  inf2serve bench URL --mode concurrency --concurrency 1,8,32 --max-new-tokens 128 "
        "--device-step-ms 10   # a synthetic model (handler.backend: synthetic) of 10 ms steps",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("url", help="inference URL, e.g. http://127.0.0.1:8080/predictions/NAME "
                   "(an OpenAI base URL `serve` printed is turned into it)")
    auth = p.add_mutually_exclusive_group()
    auth.add_argument("--token", help="inference token (Authorization: Bearer)")
    auth.add_argument("--token-file", help="TorchServe key_file.json; its inference key is used")
    p.add_argument("--run-dir", default=".serve",
                   help="run directory of `inf2serve serve` (default .serve): its key_file.json "
                   "when no --token or --token-file is given, its server.json for hints")
    p.add_argument("--mode", choices=("sync", "concurrency", "rate", "all"), default="all",
                   help="which scenarios to run (default all; see modes above)")
    p.add_argument("--concurrency", type=_csv(int), default=[1, 5, 10, 20],
                   help="closed-loop concurrency levels (default 1,5,10,20)")
    p.add_argument("--rates", type=_csv(float), default=[0.5, 1.0, 2.0],
                   help="Poisson arrival rates in requests/s (default 0.5,1,2)")
    bound = p.add_mutually_exclusive_group()
    bound.add_argument("--requests", type=int, help=f"requests per scenario "
                       f"(default {DEFAULT_REQUESTS})")
    bound.add_argument("--duration", type=float, help="seconds per scenario instead of a count")
    prompts = p.add_mutually_exclusive_group()
    prompts.add_argument("--prompt-tokens", type=int, default=30,
                         help="generated prompts of about this many tokens (default 30)")
    prompts.add_argument("--prompts-file", help="one prompt per line (or JSONL with \"prompt\")")
    p.add_argument("--tokenizer", type=Path,
                   help="local tokenizer directory that sizes --prompt-tokens exactly "
                   "(default: one word counts as one token)")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens each request asks for (default 64)")
    p.add_argument("--min-new-tokens", type=int, default=0,
                   help="suppress EOS until this many tokens, for equal-length outputs")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0, help="prompts, arrivals and request seeds")
    p.add_argument("--price-per-hour", type=float, help="instance USD/hour, for $/1M tokens")
    p.add_argument("--timeout", type=float, default=loadgen.DEFAULT_TIMEOUT_S,
                   help="seconds per request before it counts as a timeout error (default "
                   f"{loadgen.DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--out", type=Path, default=Path("bench-results"),
                   help="report directory (default bench-results); if it holds a report "
                   "already, a new timestamped folder inside it (unless --append)")
    p.add_argument("--label", default="default",
                   help="name of this setup in the report (default: default)")
    p.add_argument("--device-step-ms", type=float,
                   help="the served model's decode step (a synthetic backend's decode_step_ms): "
                   "adds host efficiency, tokens/s / (streams / step), per concurrency level "
                   "(give --requests as a multiple of each level: a part-filled last wave "
                   "leaves the device idle and counts against it)")
    p.add_argument("--append", action="store_true",
                   help="keep the other labels already in OUT/bench.json (compare setups), "
                   "with their records where OUT/raw/records.json is from that report")
    p.set_defaults(func=_run)
