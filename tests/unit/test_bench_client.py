"""The bench client end to end against a fake streaming server on 127.0.0.1.

The fake speaks the server's contract: chunked NDJSON lines with sleeps between
them, a final line with token counts, JSON errors with 4xx/5xx, and it records
what it was sent and how many requests were in flight at once.
"""

from __future__ import annotations

import itertools
import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from archive_tools import bench_report, cli
from archive_tools.bench_stats import Scenario
from archive_tools.loadgen import GenParams, build_prompts, run_scenario

TOKEN = "secret"


class FakeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive and chunked transfer-encoding
    disable_nagle_algorithm = True  # else each small chunk waits ~40 ms for a delayed ACK

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def _json(self, status: int, payload: dict, headers: dict | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _chunk(self, payload: dict) -> None:
        data = (json.dumps(payload) + "\n").encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        url = urlsplit(self.path)
        delay = float(parse_qs(url.query).get("delay", ["0.005"])[0])
        srv = self.server
        with srv.lock:
            srv.received.append((url.path, body, self.headers.get("Authorization")))
        if url.path.startswith("/predictions/ts") and self.headers.get(
                "Authorization") != f"Bearer {TOKEN}":  # TorchServe 0.12's token refusal
            return self._json(400, {"code": 400, "type": "InvalidKeyException", "message":
                                    "Token Authorization failed. Token either incorrect, "
                                    "expired, or not provided correctly"})
        if url.path == "/predictions/gone":
            return self._json(404, {"code": 404, "type": "ModelNotFoundException",
                                    "message": "Model not found: gone"})
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._json(401, {"error": {"message": "missing or bad token",
                                              "type": "auth", "field": None, "code": 401}})
        if url.path == "/predictions/busy" or (url.path == "/predictions/mixed"
                                               and body["seed"] == 0):
            return self._json(503, {"error": {"message": "no free slot", "type": "capacity",
                                              "field": None, "code": 503}}, {"Retry-After": "1"})
        if url.path == "/predictions/bad" or (url.path == "/predictions/mixed"
                                              and body["seed"] == 1):
            return self._json(400, {"error": {"message": "max_new_tokens: too large",
                                              "type": "invalid_request",
                                              "field": "max_new_tokens", "code": 400}})
        with srv.lock:
            srv.in_flight += 1
            srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/x-ndjson")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            n = body["max_new_tokens"]
            for i in range(n):
                time.sleep(delay)
                self._chunk({"text": f" tok{i}"})
                if url.path == "/predictions/midstream" and i == 1:
                    self._chunk({"error": {"message": "backend failed", "type": "generation"}})
                    break
                if url.path == "/predictions/cut" and i == 1:  # connection dropped mid-chunk
                    self.wfile.write(b"40\r\n{\"text\": ")
                    self.wfile.flush()
                    self.close_connection = True
                    return
            else:
                self._chunk({"text": "", "finish_reason": "length",
                             "prompt_tokens": len(body["prompt"].split()),
                             "completion_tokens": n})
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        finally:
            with srv.lock:
                srv.in_flight -= 1


class QuietServer(ThreadingHTTPServer):
    """Records handler errors instead of printing them into the CLI's captured stderr.

    A client hang-up (the CLI stops at the first 401) made socketserver print a
    traceback there and failed test_cli_one_line_errors once in CI. Hang-ups are
    expected; any other handler error fails the test at fixture teardown.
    """

    def handle_error(self, request, client_address) -> None:
        self.errors.append(sys.exc_info()[1])


@pytest.fixture
def server():
    srv = QuietServer(("127.0.0.1", 0), FakeHandler)
    srv.daemon_threads = True
    srv.lock, srv.received, srv.in_flight, srv.max_in_flight = threading.Lock(), [], 0, 0
    srv.errors = []
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=5)
    unexpected = [e for e in srv.errors if not isinstance(e, ConnectionError)]
    assert not unexpected, f"fake server handler errors: {unexpected!r}"


@pytest.fixture
def bench_cli(monkeypatch):
    """cli.main with only the bench group, so other groups' work in progress cannot break it."""
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("archive_tools.bench_cmd",))
    return cli.main


PARAMS = GenParams(max_new_tokens=5, min_new_tokens=5, temperature=0.0, seed=0)


def test_closed_loop_measures_stream(server):
    srv, base = server
    prompts = build_prompts(6, prompt_tokens=12)
    result = run_scenario(f"{base}/predictions/ok?delay=0.01", TOKEN,
                          Scenario("concurrency", 3, requests=6), prompts, PARAMS,
                          label="fake", timeout_s=10)
    assert len(result.records) == 6 and all(r.ok for r in result.records)
    for r in result.records:
        assert r.status == 200 and r.finish_reason == "length"
        assert 0 < r.ttft_s < r.e2e_s
        assert r.completion_tokens == 5 and r.prompt_tokens == 12
        assert len(r.itl_s) == 4 and all(g > 0 for g in r.itl_s)
    s = result.summary
    assert s.output_tokens == 30 and s.output_tokens_per_s > 0
    assert s.ttft.p50 < s.e2e.p50 and s.itl.count == 24
    assert srv.max_in_flight <= 3
    by_stream: dict = {}  # each stream's requests one after another, never at once
    for r in sorted(result.records, key=lambda r: r.start_s):
        by_stream.setdefault(r.stream, []).append(r)
    assert sorted(by_stream) == [0, 1, 2]
    for mine in by_stream.values():
        assert all(a.start_s + a.e2e_s <= b.start_s for a, b in itertools.pairwise(mine))
    path, body, auth = srv.received[0]
    assert path == "/predictions/ok" and auth == f"Bearer {TOKEN}"
    assert body["stream"] is True and body["stream_format"] == "ndjson"
    assert sorted(b["seed"] for _, b, _ in srv.received) == list(range(6))


def test_open_loop_fires_on_schedule_regardless_of_completions(server):
    _, base = server
    # each request streams for ~0.3 s; all 5 arrivals fall well inside that window
    result = run_scenario(f"{base}/predictions/ok?delay=0.1", TOKEN,
                          Scenario("rate", 50.0, requests=5), ["hi there"], GenParams(3),
                          timeout_s=10)
    records = sorted(result.records, key=lambda r: r.index)
    assert all(r.ok for r in records) and len(records) == 5
    assert all(r.start_s >= r.scheduled_s - 1e-3 for r in records)
    assert records[-1].start_s < records[0].start_s + records[0].e2e_s


def test_duration_bound_stops_by_itself(server):
    _, base = server
    t0 = time.perf_counter()
    result = run_scenario(f"{base}/predictions/ok", TOKEN,
                          Scenario("concurrency", 2, duration_s=0.3), ["a b c"], PARAMS,
                          timeout_s=10)
    assert time.perf_counter() - t0 < 3
    assert len(result.records) >= 2 and all(r.ok for r in result.records)
    # the decision to send is taken before the end (`scheduled_s`); the send itself may
    # start a little later on a busy machine, so `start_s` is not bounded
    assert all(r.scheduled_s < 0.3 for r in result.records)


def test_error_accounting(server):
    _, base = server
    result = run_scenario(f"{base}/predictions/mixed", TOKEN,
                          Scenario("sync", 1, requests=4), ["x y"], PARAMS, timeout_s=10)
    s = result.summary
    assert (s.requests, s.ok, s.errors) == (4, 2, 2)
    assert s.errors_by_kind == {"400": 1, "503": 1}
    by_index = {r.index: r for r in result.records}
    assert by_index[0].status == 503 and "Retry-After: 1" in by_index[0].error
    assert by_index[1].status == 400 and "too large" in by_index[1].error
    mid = run_scenario(f"{base}/predictions/midstream", TOKEN,
                       Scenario("sync", 1, requests=1), ["x"], PARAMS, timeout_s=10)
    assert mid.records[0].error_kind == "stream_error"
    assert "backend failed" in mid.records[0].error


def test_transport_failures_are_recorded_per_request(server):
    _, base = server
    cut = run_scenario(f"{base}/predictions/cut", TOKEN, Scenario("sync", 1, requests=1),
                       ["x"], PARAMS, timeout_s=10)
    assert cut.records[0].error_kind == "transport" and cut.records[0].ttft_s is not None
    slow = run_scenario(f"{base}/predictions/ok?delay=2", TOKEN,
                        Scenario("sync", 1, requests=1), ["x"], PARAMS, timeout_s=0.5)
    assert slow.records[0].error_kind == "timeout" and "0.5s" in slow.records[0].error
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    refused = run_scenario(f"http://127.0.0.1:{port}/predictions/ok", TOKEN,
                           Scenario("sync", 1, requests=2), ["x"], PARAMS, timeout_s=5)
    assert [r.error_kind for r in refused.records] == ["connect", "connect"]
    assert refused.summary.errors == 2


def test_cli_writes_report_files(server, bench_cli, tmp_path, capsys):
    srv, base = server
    key_file = tmp_path / "key_file.json"
    key_file.write_text(json.dumps({"inference": {"key": TOKEN}, "management": {"key": "m"}}))
    out = tmp_path / "report"
    rc = bench_cli(["bench", f"{base}/predictions/ok", "--token-file", str(key_file),
                   "--mode", "all", "--concurrency", "1,2", "--rates", "20,40",
                   "--requests", "3", "--prompt-tokens", "8", "--max-new-tokens", "4",
                   "--price-per-hour", "1.5", "--out", str(out), "--label", "fake"])
    assert rc == 0
    names = {p.name for p in out.iterdir()}
    assert {"bench.json", "bench.md", "raw", "latency_vs_concurrency_served.png",
            "throughput_vs_concurrency_served.png", "latency_vs_rate_served.png"} <= names
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads((out / "bench.json").read_text())
    runs = doc["results"]["fake"]
    assert [r["scenario_name"] for r in runs] == ["sync", "c=1", "c=2", "rate=20/s", "rate=40/s"]
    assert all("records" not in r and r["summary"]["requests"] == 3 for r in runs)
    raw = json.loads((out / "raw" / "records.json").read_text())["results"]["fake"]
    assert all(len(r["records"]) == 3 for r in raw)
    assert runs[0]["summary"]["cost_per_1m_output_tokens"] > 0
    assert "| fake | c=2 |" in (out / "bench.md").read_text()
    assert "inf2serve bench" in capsys.readouterr().out
    # --append keeps the other labels already in the report
    rc = bench_cli(["bench", f"{base}/predictions/ok", "--token", TOKEN, "--mode", "sync",
                   "--requests", "2", "--out", str(out), "--label", "other", "--append"])
    assert rc == 0 and set(bench_report.load_report(out / "bench.json")) == {"fake", "other"}
    assert all(len(r.records) == 3 for r in bench_report.load_report(out / "bench.json")["fake"])
    # without --append a report already there is never replaced: a timestamped folder inside
    before = (out / "bench.json").read_bytes()
    capsys.readouterr()
    rc = bench_cli(["bench", f"{base}/predictions/ok", "--token", TOKEN, "--mode", "concurrency",
                   "--concurrency", "1,4", "--requests", "2", "--out", str(out)])
    assert rc == 0 and (out / "bench.json").read_bytes() == before
    (new,) = [p for p in out.iterdir() if p.is_dir() and p.name != "raw"]
    assert set(bench_report.load_report(new / "bench.json")) == {"default"}
    text = "".join(capsys.readouterr().out.split())  # rich wraps long paths anywhere
    assert f"thisrunwritesto{new}" in text and "--requests2isbelowconcurrency4" in text


def test_cli_reports_host_efficiency_against_a_device_step(server, bench_cli, tmp_path,
                                                            capsys):
    _, base = server
    out = tmp_path / "report"
    rc = bench_cli(["bench", f"{base}/predictions/ok", "--token", TOKEN, "--mode", "concurrency",
                   "--concurrency", "1,2", "--requests", "2", "--max-new-tokens", "4",
                   "--device-step-ms", "10", "--out", str(out)])
    assert rc == 0
    meta = json.loads((out / "bench.json").read_text())["meta"]
    runs = bench_report.load_report(out / "bench.json")["default"]
    assert meta["device_step_ms"] == 10 and set(meta["host_efficiency"]) == {"c=1", "c=2"}
    for r in runs:  # tokens/s over (streams / 10 ms)
        want = r.summary.output_tokens_per_s * 0.01 / r.scenario.level
        assert meta["host_efficiency"][r.scenario.name] == pytest.approx(want, abs=1e-3)
    assert "host efficiency c=2:" in capsys.readouterr().out


def test_cli_one_line_errors(server, bench_cli, tmp_path, capsys):
    _, base = server
    rc = bench_cli(["bench", f"{base}/predictions/ok", "--mode", "sync", "--requests", "2",
                   "--out", str(tmp_path / "r"), "--run-dir", str(tmp_path / "none")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "failed with 401" in err and "--token-file" in err
    assert len(err.splitlines()) == 1
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = bench_cli(["bench", f"http://127.0.0.1:{port}/predictions/m", "--mode", "sync",
                   "--requests", "1", "--timeout", "5", "--out", str(tmp_path / "r")])
    assert rc == 2 and "failed with connect" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def serve_run_dir(tmp_path: Path, base: str, models: list[str]) -> Path:
    """What `inf2serve serve` leaves in its run directory: key_file.json and server.json."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "key_file.json").write_text(json.dumps({"inference": {"key": TOKEN},
                                                   "management": {"key": "m"}}))
    (run / "server.json").write_text(json.dumps({"inference_url": base, "models": models,
                                                 "openai_url": f"{base}/v1"}))
    return run


def test_cli_takes_the_token_of_the_run_directory(server, bench_cli, tmp_path, capsys):
    _, base = server
    run = serve_run_dir(tmp_path, base, ["ok"])
    rc = bench_cli(["bench", f"{base}/predictions/ok", "--mode", "sync", "--requests", "2",
                   "--run-dir", str(run), "--out", str(tmp_path / "r")])
    assert rc == 0
    assert f"token from {run / 'key_file.json'}" in "".join(capsys.readouterr().out.split("\n"))


def test_cli_without_a_token_names_torchserves_refusal_and_the_fix(server, bench_cli,
                                                                   tmp_path, capsys):
    """TorchServe 0.12 answers a missing token with 400 InvalidKeyException, not 401."""
    _, base = server
    rc = bench_cli(["bench", f"{base}/predictions/ts", "--mode", "sync", "--requests", "2",
                   "--run-dir", str(tmp_path / "none"), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "failed with 400 ({\"code\": 400, \"type\": \"InvalidKeyException\"" in err
    assert "pass --run-dir of `inf2serve serve` or --token-file RUN_DIR/key_file.json" in err


def test_cli_a_wrong_model_names_the_served_ones(server, bench_cli, tmp_path, capsys):
    _, base = server
    run = serve_run_dir(tmp_path, base, ["ok", "other"])
    rc = bench_cli(["bench", f"{base}/predictions/gone", "--mode", "sync", "--requests", "1",
                   "--run-dir", str(run), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 2 and "failed with 404" in err and "8081" not in err
    assert f"the server of {run} serves {base}/predictions/ok, {base}/predictions/other" in err


def test_cli_exits_non_zero_when_no_request_succeeded(server, bench_cli, tmp_path, capsys):
    _, base = server
    rc = bench_cli(["bench", f"{base}/predictions/busy", "--token", TOKEN, "--mode", "sync",
                   "--requests", "2", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: no request to {base}/predictions/busy succeeded "
                                      "(2 x 503; e.g. no free slot (Retry-After: 1))"), err
    assert (tmp_path / "r" / "bench.json").is_file()  # the report of the failures is written


@pytest.mark.parametrize("path, posted", [("/predictions/ok/1.0/v1", "/predictions/ok/1.0"),
                                          ("/v1", "/predictions/ok")])
def test_cli_takes_the_openai_base_urls_serve_prints(server, bench_cli, tmp_path, capsys,
                                                     path, posted):
    srv, base = server
    run = serve_run_dir(tmp_path, base, ["ok"])
    rc = bench_cli(["bench", f"{base}{path}", "--mode", "sync", "--requests", "1",
                   "--run-dir", str(run), "--out", str(tmp_path / "r")])
    assert rc == 0, capsys.readouterr().err
    assert {p for p, _, _ in srv.received} == {posted}
    assert "OpenAI base URL" in capsys.readouterr().out.replace("\n", "")
    (run / "server.json").write_text(json.dumps({"inference_url": base, "models": ["a", "b"]}))
    if path == "/v1":  # two models behind one base URL: which one is the user's to say
        rc = bench_cli(["bench", f"{base}/v1", "--run-dir", str(run), "--requests", "1"])
        err = capsys.readouterr().err
        assert rc == 2 and f"inference URL: {base}/predictions/a, {base}/predictions/b" in err


def test_a_level_given_twice_is_one_scenario() -> None:
    from archive_tools.bench_cmd import _csv

    assert _csv(int)("1,4,1") == [1, 4]
