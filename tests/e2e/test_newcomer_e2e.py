"""A newcomer's blockers, through a real TorchServe (issues 16 and 37).

- a token that expires: the printed one stops working, `inf2serve token` gives a fresh
  one; health checks: /ping needs the token, the metrics port does not;
- a dual-format checkpoint (safetensors + pytorch_model.bin) is packaged once and served;
- a worker that dies while loading is reported by `serve` at once, with the reason, and so
  is one that dies before it even connects, with no word of its own;
- a run directory whose socket paths would pass the Unix limit (every test here uses one).
"""

from __future__ import annotations

import json
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest

from archive_tools import serve, short_tmp
from archive_tools.cli import main
from archive_tools.package import package
from tests.e2e.harness import attach_logs_fixture, make_config, post, running_server
from tests.unit.test_checkpoint_checks import save_bin, tokenizer_model_only
from tests.unit.test_package_user_files import members

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("java") is None, reason="TorchServe needs a Java 17 runtime"),
]
CONFIG = Path(__file__).resolve().parents[2] / "model_configs" / "tiny-llama-cpu.yaml"
REQUEST = {"prompt": "Hello", "max_new_tokens": 4, "stream": False}
EXPIRY_MIN = 0.25  # token_expiration_min: TorchServe takes a fraction (Double.valueOf)


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("newcomer")
    dual = root / "dual"
    shutil.copytree(tiny_checkpoint, dual)
    save_bin(dual)
    assert main(["package", "--config", str(CONFIG), "--checkpoint", str(dual), "--name",
                 "dual", "--out", str(root / "store")]) == 0
    # TorchServe's worker sockets would be RUN/tmp/.ts.sock.9000: 130+ bytes, past 107
    run = root / ("a-long-run-directory-" * 5) / "run"
    assert len(str(run / "tmp" / ".ts.sock.9000")) > short_tmp.SOCKET_PATH_MAX
    with running_server(root / "store", run, ["dual"],
                        extra_props={"token_expiration_min": str(EXPIRY_MIN)}) as s:
        yield s


_attach_logs = attach_logs_fixture()


def token(server: serve.Server) -> str:
    assert main(["token", "--run-dir", str(server.run_dir), "-q"]) == 0
    return json.loads((server.run_dir / "key_file.json").read_text())["inference"]["key"]


def wait_until_expired(server: serve.Server) -> None:
    """Until the key file's inference expiry has passed (TorchServe's own clock: Instant)."""
    keys = json.loads((server.run_dir / "key_file.json").read_text())
    expires = datetime.fromisoformat(keys["inference"]["expiration time"].replace("Z", "+00:00"))
    while datetime.now(timezone.utc) <= expires:
        time.sleep(0.5)


def test_expired_token_then_a_fresh_one(server: serve.Server, capsys) -> None:
    wait_until_expired(server)
    r = post(server, "dual", REQUEST)  # the token `serve` printed
    assert r.status == 400 and "InvalidKeyException" in r.text  # what users saw
    assert main(["token", "--run-dir", str(server.run_dir)]) == 0
    out = capsys.readouterr().out
    fresh = json.loads((server.run_dir / "key_file.json").read_text())["inference"]["key"]
    assert fresh in out and "previous one no longer works" in out
    r = post(server, "dual", REQUEST, headers={"Authorization": f"Bearer {fresh}"})
    assert r.status == 200 and r.json()["completion_tokens"] == 4


def test_health_checks(server: serve.Server) -> None:
    """/ping is behind the inference token in 0.12 (ServerInitializer.java:66-74); the
    metrics port has no token handler (ServerInitializer.java:98-103)."""
    assert httpx.get(f"{server.inference_url}/ping", timeout=10).status_code == 400
    r = httpx.get(f"{server.inference_url}/ping", timeout=10,
                  headers={"Authorization": f"Bearer {token(server)}"})
    assert r.status_code == 200 and r.json()["status"] == "Healthy"
    assert httpx.get(f"{server.metrics_url}/metrics", timeout=10).status_code == 200


def test_dual_format_checkpoint_is_packaged_once_and_served(server: serve.Server) -> None:
    archive = next(Path(server.run_dir).parent.parent.glob("store/dual.mar"))
    names = members(archive)
    assert "model/model.safetensors" in names and "model/pytorch_model.bin" not in names
    r = post(server, "dual", REQUEST, headers={"Authorization": f"Bearer {token(server)}"})
    assert r.status == 200 and r.json()["completion_tokens"] == 4


def test_worker_death_at_load_is_reported_at_once(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """A tokenizer.model-only checkpoint slipped past `package` (the files were changed in the
    model store afterwards): `serve` stops at the first death with the worker's reason
    instead of waiting out its READY timeout while TorchServe retries."""
    store = tmp_path / "store"
    inline = make_config(tmp_path / "inline.yaml", handler={"engine_process": "inline"})
    target = package(inline, tiny_checkpoint, "broken", "no-archive", store)  # no child: faster
    tokenizer_model_only(target / "model")
    with pytest.raises(serve.Inf2ServeError) as info:
        serve.start(store, ["broken"], tmp_path / "run", ready_timeout_s=600)
    first = str(info.value).splitlines()[0]
    assert first.startswith("model broken: a worker died while loading the model: ")
    assert "tiktoken" in first, str(info.value)  # the reason, from the worker's traceback
    assert not serve._alive(serve._pid(tmp_path / "run"))  # and the server was stopped


def test_a_worker_that_dies_before_it_connects_is_reported(tiny_checkpoint: Path,
                                                           tmp_path: Path) -> None:
    """Whatever kills a worker, `serve` stops once TorchServe has restarted it a few times,
    with the frontend's words: here each worker exits at start-up without a word (as one
    killed for memory would), before it binds its socket, so no "Worker disconnected"."""
    store = tmp_path / "store"
    inline = make_config(tmp_path / "inline.yaml", handler={"engine_process": "inline"})
    package(inline, tiny_checkpoint, "silent", "no-archive", store)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(  # only TorchServe's worker, not its launcher
        "import os, sys\n"
        "if sys.argv and sys.argv[0].endswith('model_service_worker.py'):\n"
        "    os._exit(1)\n")
    with pytest.raises(serve.Inf2ServeError) as info:
        serve.start(store, ["silent"], tmp_path / "run", env={"PYTHONPATH": str(site)},
                    ready_timeout_s=600)
    first = str(info.value).splitlines()[0]
    assert first.startswith("model silent: a worker died while loading the model: "), first
    assert "the worker wrote no traceback" in first
    assert not serve._alive(serve._pid(tmp_path / "run"))  # and the server was stopped
    assert not (tmp_path / "run" / "tmp_link").exists()  # nor its short link left behind
