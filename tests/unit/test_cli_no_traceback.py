"""Every `inf2serve` command on damaged input: one `error:` line with the remedy, a non-zero
exit, never a traceback (the `hf` CLI's rule); the traceback only with --debug or
INF2SERVE_DEBUG=1. No TorchServe is started: every `serve` case fails before it would be."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from archive_tools import cli
from archive_tools.cli import build_parser, main
from archive_tools.package import package

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "model_configs" / "tiny-llama-cpu.yaml"
UNREACHABLE = "http://127.0.0.1:1/predictions/tiny"  # port 1: connection refused at once


@pytest.fixture(scope="module")
def bad(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Damaged inputs by name (absolute paths)."""
    root = tmp_path_factory.mktemp("damaged")
    p = {"missing": root / "missing", "empty": root / "empty", "afile": root / "afile.txt"}
    p["empty"].mkdir()
    p["afile"].write_text("not what was expected\n")
    # checkpoints: a safetensors header that is noise, a file cut short, a config.json that is
    # no JSON, an index naming a shard that is not there
    for name in ("badst", "cutst", "badjson", "noshard"):
        shutil.copytree(tiny_checkpoint, root / name)
        p[name] = root / name
    st = tiny_checkpoint / "model.safetensors"
    (p["badst"] / "model.safetensors").write_bytes(b"\xff" * 8 + st.read_bytes()[8:64])
    (p["cutst"] / "model.safetensors").write_bytes(st.read_bytes()[:-100])
    (p["badjson"] / "config.json").write_text('{"hidden_size": ')
    (p["noshard"] / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001-of-00002.safetensors"}}')
    # archives: a .mar that is no zip, a folder without a manifest, folders with damaged parts
    p["badmar"] = root / "bad.mar"
    p["badmar"].write_text("not a zip\n")
    store = root / "store"
    good = package(CONFIG, tiny_checkpoint, "tiny", "no-archive", store)
    for name, part, data in (("arch_manifest", "MAR-INF/MANIFEST.json", b"{"),
                             ("arch_st", "model/model.safetensors", b"\xff" * 16),
                             ("arch_json", "model/config.json", b'{"x": '),
                             ("arch_yaml", "model-config.yaml", b"{[")):
        p[name] = root / name
        shutil.copytree(good, p[name])
        (p[name] / part).write_bytes(data)
    p["store_empty"] = root / "store_empty"
    p["store_empty"].mkdir()
    p["store_badmar"] = root / "store_badmar"
    p["store_badmar"].mkdir()
    shutil.copy(p["badmar"], p["store_badmar"] / "tiny.mar")
    p["store"] = store
    # YAML and JSON that do not parse, where a config and a key file are expected
    p["badyaml"] = root / "bad.yaml"
    p["badyaml"].write_text("handler: {backend: [\n")
    p["badkeys"] = root / "key_file.json"
    p["badkeys"].write_text("{")
    p["cache_bad"] = root / "cache_bad"
    (p["cache_bad"] / "entry").mkdir(parents=True)
    (p["cache_bad"] / "entry" / "metadata.json").write_text("{")
    p["config"] = CONFIG
    return {k: str(v) for k, v in p.items()}


# (command line with {input} names), every one must end in exactly one `error:` line
CASES = [
    "demo-model {afile}",
    "demo-model {afile}/sub",
    "prepare {missing} {empty}/out",
    "prepare {empty} {empty}/out",
    "prepare {afile} {empty}/out",
    "prepare {badst} {empty}/out",
    "prepare {cutst} {empty}/out",
    "prepare {badjson} {empty}/out",
    "prepare {noshard} {empty}/out",
    "package --config {config} --checkpoint {missing} --name x --out {empty}/s",
    "package --config {config} --checkpoint {empty} --name x --out {empty}/s",
    "package --config {config} --checkpoint {afile} --name x --out {empty}/s",
    "package --config {config} --checkpoint {badst} --name x --out {empty}/s",
    "package --config {config} --checkpoint {cutst} --name x --out {empty}/s",
    "package --config {config} --checkpoint {badjson} --name x --out {empty}/s",
    "package --config {config} --checkpoint {noshard} --name x --out {empty}/s",
    "package --config {missing} --checkpoint {badst} --name x --out {empty}/s",
    "package --config {badyaml} --checkpoint {badst} --name x --out {empty}/s",
    "compile {missing}",
    "compile {empty}",
    "compile {afile}",
    "compile {badmar}",
    "compile {arch_yaml}",
    "inspect {missing}",
    "inspect {empty}",
    "inspect {afile}",
    "inspect {badmar}",
    "inspect {arch_manifest}",
    "inspect {arch_st}",
    "inspect {arch_json}",
    "inspect {arch_yaml}",
    "serve --model-store {missing} --run-dir {empty}/run",
    "serve --model-store {store_empty} --run-dir {empty}/run",
    "serve --model-store {afile} --run-dir {empty}/run",
    "serve --model-store {store_badmar} --run-dir {empty}/run",
    "serve --model-store {store} --models nothere --run-dir {empty}/run",
    "serve --model-store {store} --models tiny --run-dir {afile}",
    "token --run-dir {missing}",
    "token --run-dir {afile}",
    "stop --run-dir {afile}",
    "export --target sagemaker {missing} {empty}/x",
    "export --target kserve {badmar} {empty}/x",
    "export --target kubernetes {arch_st} {empty}/x",
    "export --target kserve {arch_manifest} {empty}/x",
    "validate {missing}",
    "validate {badyaml}",
    "validate {afile}",
    "validate {config} --checkpoint {missing}",
    "validate {config} --checkpoint {empty}",
    "validate {config} --checkpoint {afile}",
    "validate {config} --checkpoint {badjson}",
    "validate {config} --model-json {badjson}/config.json",
    "cache ls --cache-dir {missing}",
    "cache ls --cache-dir {afile}",
    "cache verify --cache-dir {missing}",
    "cache prune --cache-dir {afile} --corrupt",
    "cache pack --cache-dir {missing} {empty}",
    "cache pack --cache-dir {empty} {missing}",
    "bench notaurl --requests 1",
    "bench " + UNREACHABLE + " --token-file {missing} --requests 1",
    "bench " + UNREACHABLE + " --token-file {badkeys} --requests 1",
    "bench " + UNREACHABLE + " --prompts-file {missing} --requests 1",
    "bench " + UNREACHABLE + " --tokenizer {badjson} --requests 1",
    "bench " + UNREACHABLE + " --requests 1 --out {empty}/bench",
    "chat --run-dir {missing}",
    "chat --run-dir {afile}",
    "chat --run-dir {empty}",
    "chat --url notaurl",
    "chat --url " + UNREACHABLE + "/1.0/v1 --token-file {badkeys}",
]


def _argv(case: str, bad: dict[str, str]) -> list[str]:
    return case.format(**bad).split()


def _check(code: int, out: str) -> None:
    assert code != 0, out
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out
    assert len(errors[0]) > len("error: ") + 10, out  # says something


@pytest.mark.parametrize("case", CASES)
def test_damaged_input_is_one_error_line(case: str, bad: dict[str, str], capsys) -> None:
    code = main(_argv(case, bad))
    captured = capsys.readouterr()
    _check(code, captured.out + captured.err)


def test_every_command_is_tried() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    tried = {case.split()[0] for case in CASES}
    untried = set(sub.choices) - tried
    assert not untried, f"add damaged-input cases for: {sorted(untried)}"


def test_a_report_of_bad_cache_entries_fails_with_the_fix(bad: dict[str, str], capsys) -> None:
    """`cache verify` is a report, not an error: the bad entry and the fix, exit 1."""
    code = main(["cache", "verify", "--cache-dir", bad["cache_bad"]])
    out = capsys.readouterr().out
    assert code == 1 and "Traceback" not in out
    assert "metadata.json: not valid JSON" in out and "cache prune --corrupt" in out


def test_an_unexpected_error_names_its_type_and_how_to_see_the_traceback(
        monkeypatch, capsys, bad: dict[str, str]) -> None:
    def boom(args) -> int:
        raise RuntimeError("something\nunexpected")

    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    parser = build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    parser.set_defaults(func=boom)
    sub = next(a for a in parser._actions if a.dest == "command")
    sub.choices["stop"].set_defaults(func=boom)
    assert main(["stop", "--run-dir", bad["empty"]]) == 1
    err = capsys.readouterr().err
    assert err == ("error: RuntimeError: something unexpected (rerun with --debug, or "
                   "INF2SERVE_DEBUG=1, for the traceback)\n")
    with pytest.raises(RuntimeError):
        main(["--debug", "stop", "--run-dir", bad["empty"]])
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    with pytest.raises(RuntimeError):
        main(["stop", "--run-dir", bad["empty"]])


@pytest.mark.parametrize("error,want", [
    (FileNotFoundError(2, "No such file or directory", "/x/y"),
     "/x/y: No such file or directory; check the path"),
    (NotADirectoryError(20, "Not a directory", "/x/f"), "/x/f: Not a directory; a directory"),
    (subprocess.CalledProcessError(2, ["/venv/bin/torchserve", "--start"]),
     "torchserve exited with status 2"),
])
def test_library_errors_read_as_one_line_with_the_remedy(error, want) -> None:
    message = cli.known_error(error)
    assert message is not None and message.startswith(want) and "\n" not in message


def _run_cli(args: list[str], **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != cli.DEBUG_ENV}
    full_env.update(PYTHONPATH=str(REPO), **env)
    return subprocess.run([sys.executable, "-m", "archive_tools.cli", *args], cwd=REPO,
                          env=full_env, capture_output=True, text=True, timeout=120)


def test_the_real_exit_path(bad: dict[str, str]) -> None:
    """Through the interpreter's own exit: status, stderr, nothing else."""
    r = _run_cli(["prepare", bad["badst"], f"{bad['empty']}/out"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"error: SRC {bad['badst']}/model.safetensors: ")
    assert r.stderr.count("\n") == 1
    r = _run_cli(["serve", "--model-store", bad["store_empty"], "--run-dir", f"{bad['empty']}/r"])
    assert r.returncode == 2 and r.stderr.startswith("error: --model-store ")
    assert "no archives" in r.stderr and "inf2serve package" in r.stderr
    assert not Path(f"{bad['empty']}/r").exists()  # failed before TorchServe would start


def test_the_debug_variable_shows_the_traceback(bad: dict[str, str]) -> None:
    r = _run_cli(["demo-model", bad["afile"]], INF2SERVE_DEBUG="1")
    assert r.returncode != 0 and "Traceback" in r.stderr
