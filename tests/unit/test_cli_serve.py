"""`inf2serve serve` output: every address a user needs, where tokens and logs are, how to stop."""

from __future__ import annotations

from pathlib import Path

from archive_tools import serve


def test_describe_lists_addresses_tokens_logs_and_stop(tmp_path: Path, monkeypatch) -> None:
    server = serve.Server(tmp_path, "http://127.0.0.1:1001", "http://127.0.0.1:1002",
                          "http://127.0.0.1:1003", "tok-inf", "tok-mgmt", 1)
    monkeypatch.setattr(serve, "_model_version", lambda s, m: "2.5")
    monkeypatch.setattr(serve.shutil, "which", lambda name: None)  # inf2serve not on PATH
    text = serve.describe(server, "tiny", ".serve")
    for want in ("http://127.0.0.1:1001/predictions/tiny",
                 "http://127.0.0.1:1001/predictions/tiny/2.5/v1",  # OpenAI base_url
                 "management  http://127.0.0.1:1002", "http://127.0.0.1:1003/metrics",
                 str(tmp_path / "key_file.json"), str(tmp_path / "logs" / "model_log.log"),
                 "Authorization: Bearer tok-inf"):
        assert want in text, want
    assert "tok-mgmt" not in text
    stop = text.splitlines()[-1].strip()
    assert stop.endswith("stop --run-dir .serve") and not stop.startswith("inf2serve ")
