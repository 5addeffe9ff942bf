"""Every `inf2serve` command on damaged input: one `error:` line with the remedy, a non-zero
exit, never a traceback (the `hf` CLI's rule); the traceback only with --debug or
INF2SERVE_DEBUG=1. No TorchServe is started: every `serve` case fails before it would be."""

from __future__ import annotations

import json
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
    # a key given twice, a Neuron-only setting on torch, a neuron config
    p["twice"] = root / "twice.yaml"
    p["twice"].write_text("asyncCommunication: true\nhandler:\n  batch_size: 8\n"
                          "  batch_size: 2\n")
    p["torchquant"] = root / "torchquant.yaml"
    p["torchquant"].write_text(CONFIG.read_text().replace(
        "handler:\n", "handler:\n  neuron: {quantization: {weights: int8}}\n", 1))
    p["neuron"] = root / "neuron.yaml"
    p["neuron"].write_text(CONFIG.read_text().replace("backend: torch", "backend: neuron"))
    # checkpoints that load here but not where they are served: a config.json that does not
    # describe the weights, a chat template that does not compile, a tokenizer_config.json
    # transformers 4.x cannot read, a tokenizer.json that is no JSON
    for name, file, key, value in (("bigvocab", "config.json", "vocab_size", 2048),
                                   ("badtemplate", "tokenizer_config.json", "chat_template",
                                    "{% for m in messages %}{{ m }"),
                                   ("tf5tok", "tokenizer_config.json", "tokenizer_class",
                                    "TokenizersBackend")):
        p[name] = shutil.copytree(tiny_checkpoint, root / name)
        data = json.loads((p[name] / file).read_text())
        data[key] = value
        (p[name] / file).write_text(json.dumps(data))
    p["badtok"] = shutil.copytree(tiny_checkpoint, root / "badtok")
    (p["badtok"] / "tokenizer.json").write_text('{"version": ')
    p["tiny"] = tiny_checkpoint
    return {k: str(v) for k, v in p.items()}


# (command line with {input} names, what its one `error:` line must name: the file, the key
# or the value at fault, with the inputs filled in)
CASES = [
    ("demo-model {afile}", "{afile}: Not a directory"),
    ("demo-model {afile}/sub", "{afile}: File exists"),
    ("prepare {missing} {empty}/out", "SRC {missing}: no such directory"),
    ("prepare {empty} {empty}/out", "SRC {empty}: no config.json"),
    ("prepare {afile} {empty}/out", "SRC {afile}: a file, not a directory"),
    ("prepare {badst} {empty}/out", "SRC {badst}/model.safetensors: not a readable safetensors"),
    ("prepare {cutst} {empty}/out", "SRC {cutst}/model.safetensors: not a readable safetensors"),
    ("prepare {badjson} {empty}/out", "SRC {badjson}/config.json: not valid JSON"),
    ("prepare {badtok} {empty}/out", "SRC {badtok}/tokenizer.json: not valid JSON"),
    ("prepare {noshard} {empty}/out", "SRC {noshard}: model.safetensors.index.json lists 1 "
                                      "shard(s) that are not there "
                                      "(model-00001-of-00002.safetensors)"),
    ("package --config {config} --checkpoint {missing} --name x --out {empty}/s",
     "--checkpoint {missing}: no such directory"),
    ("package --config {config} --checkpoint {empty} --name x --out {empty}/s",
     "--checkpoint {empty}: no config.json"),
    ("package --config {config} --checkpoint {afile} --name x --out {empty}/s",
     "--checkpoint {afile}: a file, not a directory"),
    ("package --config {config} --checkpoint {badst} --name x --out {empty}/s",
     "{badst}/model.safetensors: damaged safetensors header (length prefix"),
    ("package --config {config} --checkpoint {cutst} --name x --out {empty}/s",
     "{cutst}/model.safetensors: file cut short"),
    ("package --config {config} --checkpoint {badjson} --name x --out {empty}/s",
     "{badjson}/config.json: not valid JSON"),
    ("package --config {config} --checkpoint {noshard} --name x --out {empty}/s",
     "{noshard}/model-00001-of-00002.safetensors: listed in model.safetensors.index.json but "
     "missing"),
    ("package --config {missing} --checkpoint {badst} --name x --out {empty}/s",
     "{missing}: no such file"),
    ("package --config {badyaml} --checkpoint {badst} --name x --out {empty}/s",
     "{badyaml}: not valid YAML"),
    ("package --config {twice} --checkpoint {badst} --name x --out {empty}/s",
     "{twice}: handler.batch_size is given twice, at line 3 and line 4"),
    ("package --config {torchquant} --checkpoint {badst} --name x --out {empty}/s",
     "handler.neuron.quantization.weights: set, but handler.backend is 'torch'"),
    ("package --config {config} --checkpoint {bigvocab} --name x --out {empty}/s",
     "{bigvocab}/model.safetensors: tensor 'model.embed_tokens.weight' is [1024, 64], but "
     "{bigvocab}/config.json implies [2048, 64]"),
    ("package --config {config} --checkpoint {badtemplate} --name x --out {empty}/s",
     "{badtemplate}/tokenizer_config.json chat_template: the chat template does not compile"),
    ("package --config {config} --checkpoint {tiny} --draft-checkpoint {tiny} --name x "
     "--out {empty}/s", "--draft-checkpoint {tiny}: speculative decoding runs on the Neuron "
                        "backends only"),
    ("package --config {neuron} --checkpoint {tf5tok} --name x --out {empty}/s",
     "{tf5tok}/tokenizer_config.json: tokenizer_class 'TokenizersBackend'"),
    ("compile {missing}", "ARCHIVE_DIR {missing}: no such file or directory"),
    ("compile {empty}", "ARCHIVE_DIR {empty}: no MAR-INF/MANIFEST.json"),
    ("compile {afile}", "ARCHIVE_DIR {afile}: compile writes into the archive's neuron_cache/"),
    ("compile {badmar}", "ARCHIVE_DIR {badmar}: compile writes into the archive's neuron_cache/"),
    ("compile {arch_yaml}", "{arch_yaml}/model-config.yaml: not valid YAML"),
    ("inspect {missing}", "ARCHIVE {missing}: no such file or directory"),
    ("inspect {empty}", "ARCHIVE {empty}: no MAR-INF/MANIFEST.json"),
    ("inspect {afile}", "ARCHIVE {afile}: expected a .mar, a .tar.gz or an archive folder"),
    ("inspect {badmar}", "ARCHIVE {badmar}: not a zip file"),
    ("inspect {arch_manifest}", "ARCHIVE {arch_manifest}: MAR-INF/MANIFEST.json is not valid "
                                "JSON"),
    ("inspect {arch_st}", "ARCHIVE {arch_st}: model/model.safetensors has no readable "
                          "safetensors header"),
    ("inspect {arch_json}", "ARCHIVE {arch_json}: model/config.json is not valid JSON"),
    ("inspect {arch_yaml}", "ARCHIVE {arch_yaml}: model-config.yaml is not valid YAML"),
    ("serve --model-store {missing} --run-dir {empty}/run",
     "--model-store {missing}: no such directory"),
    ("serve --model-store {store_empty} --run-dir {empty}/run",
     "--model-store {store_empty}: no archives in it"),
    ("serve --model-store {afile} --run-dir {empty}/run",
     "--model-store {afile}: a file, not a directory"),
    ("serve --model-store {store_badmar} --run-dir {empty}/run",
     "--models tiny: {store_badmar}/tiny.mar is not a zip file"),
    ("serve --model-store {store} --models nothere --run-dir {empty}/run",
     "--models nothere: no nothere.mar, nothere.tar.gz or nothere/ in {store}"),
    ("serve --model-store {store} --models tiny --run-dir {afile}",
     "--run-dir {afile}: not a directory"),
    ("token --run-dir {missing}", "no TorchServe started by `inf2serve serve` in {missing}"),
    ("token --run-dir {afile}", "no TorchServe started by `inf2serve serve` in {afile}"),
    ("stop --run-dir {afile}", "--run-dir {afile}: not a directory"),
    ("export --target sagemaker {missing} {empty}/x", "ARCHIVE {missing}: no such file"),
    ("export --target kserve {badmar} {empty}/x", "ARCHIVE {badmar}: not a zip file"),
    ("export --target kubernetes {arch_st} {empty}/x",
     "ARCHIVE {arch_st}: model/model.safetensors has no readable safetensors header"),
    ("export --target kserve {arch_manifest} {empty}/x",
     "ARCHIVE {arch_manifest}: MAR-INF/MANIFEST.json is not valid JSON"),
    ("validate {missing}", "{missing}: no such file"),
    ("validate {badyaml}", "{badyaml}: not valid YAML"),
    ("validate {afile}", "{afile}: a YAML str, not a mapping of keys"),
    ("validate {twice}", "{twice}: handler.batch_size is given twice, at line 3 and line 4"),
    ("validate {config} --instance inf2.huge", "--instance 'inf2.huge': unknown"),
    ("validate {config} --checkpoint {missing}", "--checkpoint {missing}: no such directory"),
    ("validate {config} --checkpoint {empty}", "--checkpoint {empty}: no config.json"),
    ("validate {config} --checkpoint {afile}", "--checkpoint {afile}: a file, not a directory"),
    ("validate {config} --checkpoint {badjson}", "{badjson}/config.json: not valid JSON"),
    ("validate {config} --model-json {badjson}/config.json",
     "{badjson}/config.json: not valid JSON"),
    ("cache ls --cache-dir {missing}", "--cache-dir {missing}: no such directory"),
    ("cache ls --cache-dir {afile}", "--cache-dir {afile}: a file, not a directory"),
    ("cache verify --cache-dir {missing}", "--cache-dir {missing}: no such directory"),
    ("cache prune --cache-dir {afile} --corrupt", "--cache-dir {afile}: a file, not a directory"),
    ("cache pack --cache-dir {missing} {empty}", "--cache-dir {missing}: no such directory"),
    ("cache pack --cache-dir {empty} {missing}", "{empty}: no cache entries to pack"),
    ("bench notaurl --requests 1", "URL 'notaurl' is not http(s)://"),
    ("bench " + UNREACHABLE + " --token-file {missing} --requests 1",
     "cannot read token file {missing}"),
    ("bench " + UNREACHABLE + " --token-file {badkeys} --requests 1",
     "cannot read token file {badkeys}"),
    ("bench " + UNREACHABLE + " --prompts-file {missing} --requests 1",
     "cannot read --prompts-file {missing}"),
    ("bench " + UNREACHABLE + " --tokenizer {badjson} --requests 1",
     "--tokenizer {badjson}: cannot load a tokenizer there"),
    ("bench " + UNREACHABLE + " --requests 1 --run-dir {empty} --out {empty}/bench",
     "every request to " + UNREACHABLE + " failed with connect"),
    ("chat --run-dir {missing}", "no server started by `inf2serve serve` in {missing}"),
    ("chat --run-dir {afile}", "--run-dir {afile}: not a directory"),
    ("chat --run-dir {empty}", "no server started by `inf2serve serve` in {empty}"),
    ("chat --url notaurl", "--url notaurl: not an http(s) URL"),
    ("chat --url " + UNREACHABLE + "/1.0/v1 --token-file {badkeys}",
     "cannot read the inference token from {badkeys}"),
]


def _argv(case: str, bad: dict[str, str]) -> list[str]:
    return case.format(**bad).split()


def _check(code: int, out: str, named: str) -> None:
    assert code != 0, out
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out
    assert named in errors[0], f"the error line does not name {named!r}: {errors[0]}"


@pytest.mark.parametrize("case, named", CASES, ids=[case for case, _ in CASES])
def test_damaged_input_is_one_error_line_naming_the_problem(case: str, named: str,
                                                            bad: dict[str, str], capsys) -> None:
    code = main(_argv(case, bad))
    captured = capsys.readouterr()
    _check(code, captured.out + captured.err, named.format(**bad))


def test_every_command_is_tried() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    tried = {case.split()[0] for case, _ in CASES}
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


def test_a_damaged_tokenizer_json_is_a_usage_error_like_the_others(bad: dict[str, str],
                                                                   capsys) -> None:
    """prepare names the file and exits 2, as for every other damaged input file."""
    assert main(["prepare", bad["badtok"], f"{bad['empty']}/out"]) == 2
    assert capsys.readouterr().err.startswith(f"error: SRC {bad['badtok']}/tokenizer.json: ")
