"""Load generator for the TorchServe streaming contract (NDJSON over chunked HTTP).

Closed loop (`sync`, `concurrency`): N workers each send the next request when
their last one finished, so the server sees exactly N in flight. Open loop
(`rate`): requests are fired at Poisson arrival times whatever the server does,
which is how real traffic queues up. Every loop is bounded by a request count or
a duration (and MAX_REQUESTS), every request by a timeout; nothing is sent
anywhere but the given URL.

The client is aiohttp, not httpx: on a small host the load generator shares the
cores with the server it measures, and aiohttp's C HTTP parser reads a streamed
token in ~40 us of CPU where httpx's pure-Python stack takes ~140 us (measured on
this project's 2-core VM, 8 streams of NDJSON chunks).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from archive_tools.bench_stats import BenchError, RequestRecord, Scenario, ScenarioResult

if TYPE_CHECKING:  # imported where a request is sent: every `inf2serve` command
    import aiohttp  # loads this module, and aiohttp's import is ~0.5 s of CPU

MAX_REQUESTS = 100_000  # cap for --duration runs, so a fast error loop still ends
DEFAULT_TIMEOUT_S = 120.0
OnRecord = Callable[[RequestRecord], None]


@dataclass(frozen=True)
class GenParams:
    """Generation settings sent with every request; request i gets seed `seed + i`."""

    max_new_tokens: int = 64
    min_new_tokens: int = 0
    temperature: float = 0.0
    seed: int = 0

    def body(self, prompt: str, index: int) -> dict:
        return {"prompt": prompt, "max_new_tokens": self.max_new_tokens,
                "min_new_tokens": self.min_new_tokens, "temperature": self.temperature,
                "seed": self.seed + index, "stream": True, "stream_format": "ndjson"}


def check_url(url: str) -> str:
    """Accept only an absolute http(s) URL: the benchmark never goes anywhere else."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BenchError(f"URL {url!r} is not http(s)://HOST[:PORT]/predictions/NAME; "
                         "pass the model's inference URL, e.g. http://127.0.0.1:8080/predictions/llama")
    return url


def read_token(token: str | None = None, token_file: str | Path | None = None) -> str | None:
    """The inference token: given directly, or the "inference" key of TorchServe's key_file.json."""
    if token and token_file:
        raise BenchError("pass --token or --token-file, not both")
    if not token_file:
        return token or None
    path = Path(token_file)
    try:
        data = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise BenchError(f"cannot read token file {path}: {exc}; pass TorchServe's "
                         "key_file.json (written next to where torchserve started)") from exc
    entry = data.get("inference") if isinstance(data, dict) else None
    key = entry.get("key") if isinstance(entry, dict) else entry
    if not isinstance(key, str) or not key:
        raise BenchError(f"{path} has no inference key ({{\"inference\": {{\"key\": ...}}}}); "
                         "pass TorchServe's key_file.json or --token")
    return key


def _words() -> list[str]:
    text = resources.files("archive_tools").joinpath("data/corpus.txt").read_text("utf-8")
    return sorted({w for w in re.findall(r"[a-z]+", text.lower()) if 2 <= len(w) <= 8})


def build_prompts(n: int, prompt_tokens: int, seed: int = 0,
                  count_tokens: Callable[[str], int] | None = None) -> list[str]:
    """`n` different prompts of about `prompt_tokens` tokens each, reproducible from `seed`.

    Built from the short common words of the shipped corpus. Without `count_tokens`
    one word counts as one token (about right for Llama tokenizers); with it, words
    are added until the prompt reaches `prompt_tokens` -- the demo tokenizer splits
    most words into several tokens, so the bench passes it. Distinct prompts keep
    any prefix cache from flattering the numbers.
    """
    if prompt_tokens < 1:
        raise BenchError(f"--prompt-tokens {prompt_tokens} must be >= 1")
    words = _words()
    rng = random.Random(seed)
    count = count_tokens or (lambda text: len(text.split()))
    prompts = []
    for _ in range(max(n, 1)):
        picked = [rng.choice(words)]
        while count(" ".join(picked)) < prompt_tokens:
            picked.append(rng.choice(words))
        prompts.append(" ".join(picked))
    return prompts


def tokenizer_counter(path: str | Path) -> Callable[[str], int]:
    """Token count of a text with a local tokenizer directory (no download)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(Path(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise BenchError(f"--tokenizer {path}: cannot load a tokenizer there; pass the "
                         "checkpoint directory that holds tokenizer.json") from exc
    return lambda text: len(tok(text)["input_ids"])


def load_prompts(path: str | Path) -> list[str]:
    """One prompt per non-empty line; a line starting with `{` is JSON with a "prompt" field."""
    path = Path(path)
    try:
        lines = path.read_text("utf-8").splitlines()
    except OSError as exc:
        raise BenchError(f"cannot read --prompts-file {path}: {exc}") from exc
    prompts = []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                line = json.loads(line)["prompt"]
            except (ValueError, KeyError, TypeError) as exc:
                raise BenchError(f"{path}:{n}: a JSON line needs a \"prompt\" field, "
                                 'e.g. {"prompt": "Hello"}') from exc
        prompts.append(str(line))
    if not prompts:
        raise BenchError(f"--prompts-file {path} has no prompts; write one prompt per line")
    return prompts


def poisson_schedule(rate: float, seed: int = 0, n: int | None = None,
                     duration_s: float | None = None) -> list[float]:
    """Arrival offsets (s) of a Poisson process: exponential gaps of mean 1/rate.

    Bounded by `n` arrivals or by `duration_s` (arrivals strictly before it), and
    by MAX_REQUESTS in any case. The same seed gives the same schedule.
    """
    if not rate > 0:
        raise BenchError(f"rate {rate} must be > 0 requests/s")
    if n is None and duration_s is None:
        raise BenchError("a Poisson schedule needs a request count or a duration")
    limit = min(n if n is not None else MAX_REQUESTS, MAX_REQUESTS)
    rng = random.Random(seed)
    out: list[float] = []
    t = 0.0
    while len(out) < limit:
        t += rng.expovariate(rate)
        if duration_s is not None and t >= duration_s:
            break
        out.append(t)
    return out


def _error_message(raw: bytes) -> str:
    try:
        err = json.loads(raw)["error"]
        return err.get("message", str(err)) if isinstance(err, dict) else str(err)
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode("utf-8", "replace")


async def _stream(client: aiohttp.ClientSession, url: str, body: dict, rec: RequestRecord,
                  start: float) -> None:
    last: float | None = None
    async with client.post(url, json=body) as resp:
        rec.status = resp.status
        if resp.status != 200:
            rec.error_kind = str(resp.status)
            rec.error = _error_message(await resp.read())
            if resp.headers.get("Retry-After"):
                rec.error += f" (Retry-After: {resp.headers['Retry-After']})"
            return
        async for line in resp.content:  # one NDJSON line at a time, as chunks arrive
            if not line.strip():
                continue
            now = time.perf_counter()
            try:
                msg = json.loads(line)
            except ValueError:
                rec.error_kind, rec.error = "bad_line", line[:200].decode("utf-8", "replace")
                return
            if "error" in msg:
                rec.error_kind, rec.error = "stream_error", _error_message(line)
                return
            if msg.get("text"):
                if last is None:
                    rec.ttft_s = now - start
                else:
                    rec.itl_s.append(now - last)
                last = now
            if "finish_reason" in msg:
                rec.finish_reason = msg["finish_reason"]
                rec.prompt_tokens = msg.get("prompt_tokens")
                rec.completion_tokens = msg.get("completion_tokens")
    if rec.finish_reason is None:
        rec.error_kind, rec.error = "incomplete", "stream ended without a final line"


async def send_request(client: aiohttp.ClientSession, url: str, body: dict, *, index: int,
                       t0: float, scheduled_s: float, timeout_s: float) -> RequestRecord:
    """Send one streaming request and time it; never raises for a failed request."""
    import aiohttp

    start = time.perf_counter()
    rec = RequestRecord(index=index, scheduled_s=scheduled_s, start_s=start - t0, status=0)
    try:
        await asyncio.wait_for(_stream(client, url, body, rec, start), timeout_s)
    except asyncio.TimeoutError as exc:  # aiohttp's own timeouts are TimeoutErrors too
        rec.error_kind, rec.error = "timeout", f"no answer within {timeout_s:g}s ({exc!r})"
    except aiohttp.ClientConnectorError as exc:
        rec.error_kind, rec.error = "connect", str(exc)
    except aiohttp.ClientError as exc:
        rec.error_kind, rec.error = "transport", f"{type(exc).__name__}: {exc}"
    rec.e2e_s = time.perf_counter() - start
    return rec


async def _closed_loop(client: aiohttp.ClientSession, url: str, scenario: Scenario,
                       body: Callable[[int], dict], t0: float, timeout_s: float,
                       on_record: OnRecord) -> list[RequestRecord]:
    limit = min(scenario.requests or MAX_REQUESTS, MAX_REQUESTS)
    end = t0 + scenario.duration_s if scenario.duration_s else float("inf")
    counter = itertools.count()
    records: list[RequestRecord] = []

    async def worker(stream: int) -> None:
        while True:
            i = next(counter)  # workers share one counter: one event loop, no race
            now = time.perf_counter()
            if i >= limit or now >= end:
                return
            rec = await send_request(client, url, body(i), index=i, t0=t0,
                                     scheduled_s=now - t0, timeout_s=timeout_s)
            rec.stream = stream
            records.append(rec)
            on_record(rec)

    await asyncio.gather(*(worker(w) for w in range(int(scenario.level))))
    return records


async def _open_loop(client: aiohttp.ClientSession, url: str, scenario: Scenario,
                     body: Callable[[int], dict], t0: float, timeout_s: float,
                     on_record: OnRecord, seed: int) -> list[RequestRecord]:
    schedule = poisson_schedule(scenario.level, seed, scenario.requests, scenario.duration_s)
    records: list[RequestRecord] = []

    async def fire(i: int, at: float) -> None:
        rec = await send_request(client, url, body(i), index=i, t0=t0, scheduled_s=at,
                                 timeout_s=timeout_s)
        records.append(rec)
        on_record(rec)

    tasks = []
    for i, at in enumerate(schedule):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(fire(i, at)))
    await asyncio.gather(*tasks)
    return sorted(records, key=lambda r: r.index)


def expected_requests(scenario: Scenario, seed: int = 0) -> int | None:
    """How many requests the scenario will send, for a progress bar (None: time-bound)."""
    if scenario.mode == "rate":
        return len(poisson_schedule(scenario.level, seed, scenario.requests, scenario.duration_s))
    return scenario.requests


async def arun_scenario(url: str, token: str | None, scenario: Scenario, prompts: list[str],
                        params: GenParams | None = None, *, label: str = "default",
                        timeout_s: float = DEFAULT_TIMEOUT_S, price_per_hour: float | None = None,
                        on_record: OnRecord | None = None) -> ScenarioResult:
    """Async form of `run_scenario`, for callers that already run an event loop."""
    import aiohttp

    check_url(url)
    if not prompts:
        raise BenchError("no prompts; pass --prompt-tokens N or a non-empty --prompts-file")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    # Closed loop never needs more connections than workers; open loop must not queue here.
    conns = int(scenario.level) if scenario.mode != "rate" else 0  # 0: no limit
    timeout = aiohttp.ClientTimeout(total=timeout_s, connect=min(timeout_s, 10.0))

    params = params or GenParams()

    def body(i: int) -> dict:
        return params.body(prompts[i % len(prompts)], i)

    callback = on_record or (lambda rec: None)
    connector = aiohttp.TCPConnector(limit=conns)
    async with aiohttp.ClientSession(headers=headers, connector=connector, timeout=timeout,
                                     trust_env=False) as client:
        t0 = time.perf_counter()
        if scenario.mode == "rate":
            records = await _open_loop(client, url, scenario, body, t0, timeout_s, callback,
                                       params.seed)
        else:
            records = await _closed_loop(client, url, scenario, body, t0, timeout_s, callback)
        wall = time.perf_counter() - t0
    return ScenarioResult(label=label, scenario=scenario, records=records, wall_s=wall,
                          price_per_hour=price_per_hour)


def run_scenario(url: str, token: str | None, scenario: Scenario, prompts: list[str],
                 params: GenParams | None = None, **kwargs) -> ScenarioResult:
    """Run one scenario against `url` and return its raw records (summary derived).

    Example: `run_scenario(url, tok, Scenario("concurrency", 5, requests=50),
    build_prompts(50, 30), GenParams(max_new_tokens=64), label="continuous")`.
    """
    return asyncio.run(arun_scenario(url, token, scenario, prompts, params, **kwargs))
