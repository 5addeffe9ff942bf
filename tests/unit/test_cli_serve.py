"""`inf2serve serve`: every address a user needs, where tokens and logs are, how to stop; the
frontend JVM's memory bounds in its config.properties."""

from __future__ import annotations

from pathlib import Path

from archive_tools import serve, serve_cmd
from archive_tools.cli import main
from archive_tools.jvm_options import FrontendMemory


def test_describe_lists_addresses_tokens_logs_and_stop(tmp_path: Path, monkeypatch) -> None:
    server = serve.Server(tmp_path, "http://127.0.0.1:1001", "http://127.0.0.1:1002",
                          "http://127.0.0.1:1003", "tok-inf", "tok-mgmt", 1)
    monkeypatch.setattr(serve, "model_version", lambda s, m: "2.5")
    monkeypatch.setattr(serve.shutil, "which", lambda name: None)  # inf2serve not on PATH
    text = serve_cmd.describe(server, "tiny", ".serve")
    for want in ("http://127.0.0.1:1001/predictions/tiny",
                 "http://127.0.0.1:1001/predictions/tiny/2.5/v1",  # OpenAI base_url
                 "management  http://127.0.0.1:1002", "http://127.0.0.1:1003/metrics",
                 str(tmp_path / "key_file.json"), str(tmp_path / "logs" / "model_log.log"),
                 "Authorization: Bearer tok-inf"):
        assert want in text, want
    assert "tok-mgmt" not in text
    stop = text.splitlines()[-1].strip()
    assert stop.endswith("stop --run-dir .serve") and not stop.startswith("inf2serve ")


def _props(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


def test_config_properties_bound_the_frontend_jvm(tmp_path: Path) -> None:
    """TorchServe passes `vmargs` to java split on whitespace (ts/model_server.py); without
    it the JVM's heap, direct buffers and code cache grow as the machine allows."""
    path = serve.write_config_properties(tmp_path, tmp_path, (1, 2, 3, 4, 5))
    vmargs = _props(path)["vmargs"].split()
    assert vmargs == FrontendMemory().flags()
    assert "-Xms256m" in vmargs and "-Xmx256m" in vmargs
    assert any(a.startswith("-XX:MaxDirectMemorySize=") for a in vmargs)
    sized = serve.write_config_properties(tmp_path, tmp_path, (1, 2, 3, 4, 5),
                                          frontend=FrontendMemory(heap_mib=1024),
                                          native_memory_tracking=True)
    vmargs = _props(sized)["vmargs"].split()
    assert "-Xmx1024m" in vmargs and vmargs[-1] == "-XX:NativeMemoryTracking=summary"


def test_a_callers_vmargs_are_kept_after_ours(tmp_path: Path) -> None:
    path = serve.write_config_properties(tmp_path, tmp_path, (1, 2, 3, 4, 5),
                                         extra={"vmargs": "-Xmx2g", "job_queue_size": "7"})
    props = _props(path)
    assert props["vmargs"] == f"{FrontendMemory().vmargs()} -Xmx2g"  # the last -Xmx wins
    assert props["job_queue_size"] == "7"
    assert path.read_text().count("vmargs=") == 1


def test_frontend_heap_option(monkeypatch, capsys) -> None:
    seen = {}

    def fake_start(*args, **kwargs):
        seen.update(kwargs)
        raise serve.Inf2ServeError("stop here")

    monkeypatch.setattr(serve, "start", fake_start)
    assert main(["serve", "--model-store", "x", "--frontend-heap-mb", "512"]) == 2
    assert seen["frontend"] == FrontendMemory(heap_mib=512)
    assert main(["serve", "--model-store", "x", "--frontend-heap-mb", "16"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("error: --frontend-heap-mb 16: ") and "at least 64" in err


def test_printed_commands_quote_paths_with_spaces(tmp_path: Path, monkeypatch, capsys) -> None:
    """What serve and package print is pasted into a shell: a path with a space is quoted."""
    import shlex

    server = serve.Server(tmp_path, "http://127.0.0.1:1001", "http://127.0.0.1:1002",
                          "http://127.0.0.1:1003", "tok-inf", "tok-mgmt", 1)
    monkeypatch.setattr(serve, "model_version", lambda s, m: "1.0")
    run_dir = str(tmp_path / "my störe 2" / "run")
    lines = serve_cmd.describe(server, "tiny", run_dir).splitlines()
    stop, token = lines[-1].strip(), lines[-3].strip()
    assert shlex.split(stop)[-2:] == ["--run-dir", run_dir]
    assert shlex.split(token)[-2:] == ["--run-dir", run_dir]
    assert server.curl_example("tiny").startswith("curl -sN ")  # no progress meter in a pipe
    from tests.unit.test_cli_package import CONFIG, make_checkpoint

    store = tmp_path / "my störe 2"
    assert main(["package", "--config", str(CONFIG), "--checkpoint",
                 str(make_checkpoint(tmp_path / "ckpt")), "--name", "tiny", "--out",
                 str(store)]) == 0
    nxt = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("next:"))
    assert shlex.split(nxt)[1:] == ["inf2serve", "serve", "--model-store", str(store), "--models",
                                    "tiny"]
