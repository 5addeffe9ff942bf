"""`inf2serve serve` while workers load: a line per model now and then with the log to watch,
every served model named with its URLs at the end; and the log4j2.xml it starts TorchServe
with writes each line once."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from archive_tools import serve, serve_cmd, ts_logs


class FakeResponse:
    def __init__(self, status: str) -> None:
        self.status_code, self.text = 200, ""
        self._status = status

    def json(self) -> list[dict]:
        return [{"modelVersion": "1.0", "workers": [{"status": self._status}]}]


def _server(run_dir: Path, models: tuple[str, ...] = ("tiny",)) -> serve.Server:
    return serve.Server(run_dir, "http://127.0.0.1:1001", "http://127.0.0.1:1002",
                        "http://127.0.0.1:1003", "tok-inf", "tok-mgmt", 1, models)


def test_a_loading_model_is_reported_with_its_log_until_ready(tmp_path: Path,
                                                              monkeypatch) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "model_log.log").write_text(
        "2026-01-01T00:00:00,000 [INFO ] W-9000-tiny_1.0-stdout MODEL_LOG - compiling the "
        "decoder\n2026-01-01T00:00:00,000 [INFO ] W-9001-other_1.0-stdout MODEL_LOG - other\n")
    polls = {"tiny": 0, "big": 0}

    def get(url: str, **kwargs) -> FakeResponse:
        name = url.rsplit("/", 1)[1]
        polls[name] += 1
        ready = name == "tiny" and polls[name] > 3 or polls[name] > 6
        return FakeResponse("READY" if ready else "UNLOADED")

    monkeypatch.setattr(serve.httpx, "get", get)
    monkeypatch.setattr(serve, "_alive", lambda pid: True)
    monkeypatch.setattr(serve.time, "sleep", lambda s: None)
    lines: list[str] = []
    serve.wait_ready(_server(tmp_path, ("tiny", "big")), ["tiny", "big"], 60, log_sizes={},
                     progress=lines.append, progress_every_s=0.0)
    loading = [line for line in lines if ": loading (" in line]
    # one line a tick, however many models load: both while both do, then the one left
    assert loading[0].startswith("tiny, big: loading (0 s) - log: ")
    assert f"log: {logs / 'model_log.log'}; last: tiny: compiling the decoder" in loading[0]
    assert not any(line.startswith(("tiny: loading", "big, tiny")) for line in loading)
    assert loading[-1].startswith("big: loading (") and "last:" not in loading[-1]
    assert lines.index("tiny: ready (0 s)") < lines.index("big: ready (0 s)")
    assert lines[-1] == "big: ready (0 s)"


def test_no_progress_lines_before_the_interval(tmp_path: Path, monkeypatch) -> None:
    calls = iter(["UNLOADED", "READY"])
    monkeypatch.setattr(serve.httpx, "get", lambda url, **kw: FakeResponse(next(calls)))
    monkeypatch.setattr(serve, "_alive", lambda pid: True)
    monkeypatch.setattr(serve.time, "sleep", lambda s: None)
    lines: list[str] = []
    serve.wait_ready(_server(tmp_path), ["tiny"], 60, progress=lines.append)
    assert lines == ["tiny: ready (0 s)"]


def test_describe_names_every_model_with_its_urls(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(serve, "model_version", lambda s, m: {"a": "1.0", "b": "2.0"}[m])
    text = serve_cmd.describe(_server(tmp_path, ("a", "b")), ("a", "b"), ".serve")
    assert "serving 2 models:" in text.splitlines()[0]
    for name, version in (("a", "1.0"), ("b", "2.0")):
        assert f"\n  {name}\n" in text
        assert f"inference   http://127.0.0.1:1001/predictions/{name}\n" in text
        assert f"OpenAI      http://127.0.0.1:1001/predictions/{name}/{version}/v1" in text
    curls = [line for line in text.splitlines() if line.startswith("  curl ")]
    assert len(curls) == 1 and "/predictions/a " in curls[0]  # `make demo` runs this line


def test_the_store_lists_only_archives(tmp_path: Path) -> None:
    for name in ("a.mar", "b.tar.gz", "notes.txt", ".c.partial-1"):
        (tmp_path / name).write_text("x")
    (tmp_path / "d" / "MAR-INF").mkdir(parents=True)
    (tmp_path / "d" / "MAR-INF" / "MANIFEST.json").write_text("{}")
    (tmp_path / "checkpoint").mkdir()
    assert serve.store_archives(tmp_path) == ["a=a.mar", "b=b.tar.gz", "d=d"]


def test_log4j2_config_routes_every_logger_once(tmp_path: Path) -> None:
    """Stock TorchServe 0.12 routes `org.pytorch.serve` to ts_log and again through Root, so
    each line is written twice; here each named logger writes to its own file once."""
    path = ts_logs.write_log_config(tmp_path)
    root = ET.parse(path).getroot()
    appenders = {a.get("name") for a in root.find("Appenders")}
    assert appenders == {"STDOUT", "access_log", "model_log", "model_metrics", "ts_log",
                         "ts_metrics"}
    loggers = root.find("Loggers")
    files: dict[str, list[str]] = {}
    for logger in loggers.findall("Logger"):
        refs = [r.get("ref") for r in logger.findall("AppenderRef")]
        if refs:
            assert logger.get("additivity") == "false", logger.get("name")
            assert len(refs) == len(set(refs)), logger.get("name")
        for ref in refs:
            files.setdefault(ref, []).append(logger.get("name"))
    assert files["ts_log"][0] == "org.pytorch.serve"
    for name in ("access_log", "model_log", "model_metrics", "ts_metrics"):
        assert len(files[name]) == 1, name  # one logger, one file
    levels = {lg.get("name"): lg.get("level") for lg in loggers.findall("Logger")}
    assert levels["org.pytorch.serve"] == "info"  # no per-request DEBUG lines
    assert levels["org.pytorch.serve.wlm.WorkerLifeCycle"] == "warn"  # no [METRICS] echo
    for appender in root.find("Appenders").findall("RollingFile"):
        name = appender.get("name")
        assert appender.get("fileName").endswith(f"}}/{name}.log")


def test_stdout_gets_warnings_and_the_start_and_stop_lines(tmp_path: Path) -> None:
    """ts_logs.frontend_exit reads torchserve.out after "Torchserve stopped." (ModelServer)."""
    root = ET.parse(ts_logs.write_log_config(tmp_path)).getroot()
    loggers = {lg.get("name"): lg for lg in root.find("Loggers").findall("Logger")}
    model_server = [r.get("ref") for r in loggers["org.pytorch.serve.ModelServer"]]
    assert "STDOUT" in model_server
    frontend = {r.get("ref"): r.get("level") for r in loggers["org.pytorch.serve"]}
    assert frontend["STDOUT"] == "warn"
