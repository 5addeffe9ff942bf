"""A neuron archive served as an Inf2 host serves it: under the Neuron SDKs' transformers 4.x.

For each transformers 4.x overlay (tests/overlays.py): a venv of torchserve, torch and the
overlay's transformers/tokenizers/huggingface_hub, without this toolkit (tests/e2e/_venv.py);
the fake SDK on PYTHONPATH; the demo checkpoint written under this suite's transformers 5;
the archive as `inf2serve package` writes it, installed by TorchServe's per-model pip
install (install_py_dep_per_model, as SageMaker's TS_INSTALL_PY_DEP_PER_MODEL sets it,
offline). The worker reports the transformers it imported, and its greedy text equals
`generate` under transformers 5 on the same checkpoint.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from archive_tools import serve
from archive_tools.package import ENTRY_FILE
from tests.e2e._venv import ROOTS, importable, make_serving_venv
from tests.e2e.harness import ArchiveSpec, build_store, logs, post
from tests.overlays import overlay_params, transformers_version

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("java") is None, reason="TorchServe needs a Java 17 runtime"),
]

FAKES = Path(__file__).resolve().parents[1] / "fakes"
PROMPTS = ["The quick brown fox", "Once upon a time"]
MAX_NEW_TOKENS = 24
# appended to the archive's entry point: which transformers did this worker import?
REPORT = '''
import json as _json, os as _os, transformers as _transformers
with open(_os.environ["INF2SERVE_E2E_WORKER_REPORT"], "a") as _f:
    _f.write(_json.dumps({"pid": _os.getpid(), "version": _transformers.__version__,
                          "file": _transformers.__file__}) + "\\n")
'''


def _reference(checkpoint: Path) -> list[str]:
    """Greedy text of each prompt from `generate` under this process's transformers 5."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok(prompt)["input_ids"]])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_NEW_TOKENS)
        out.append(tok.decode(gen[0, ids.shape[1]:].tolist(), skip_special_tokens=True))
    return out


def _isolated_props() -> dict[str, str]:
    """Ports of its own (other TorchServes may run here) and the per-model pip install on."""
    base = random.randrange(20000, 60000, 100)
    return {"initial_worker_port": str(base), "initial_distribution_port": str(base + 50),
            "install_py_dep_per_model": "true"}


@pytest.mark.parametrize("overlay", overlay_params())
def test_neuron_archive_serves_under_transformers_4(overlay: Path, tiny_checkpoint: Path,
                                                    tmp_path: Path, monkeypatch) -> None:
    version = transformers_version(overlay)
    python = make_serving_venv(tmp_path / "venv", overlay, roots=(*ROOTS, "pip"))
    assert not importable(python, "handlers", tmp_path)  # the archive brings the runtime
    spec = ArchiveSpec(
        "tiny-neuron", {"deviceType": "neuron"},
        {"backend": "neuron", "batching": "continuous", "batch_size": 4, "threads": 1,
         "dtype": "float32",
         "neuron": {"tp_degree": 2, "cores_per_instance": 4,
                    "core_lock_dir": str(tmp_path / "core-locks")}},
        fmt="no-archive", entry_source=ENTRY_FILE.read_text() + REPORT)
    store = build_store(tmp_path, tiny_checkpoint, [spec])
    report = tmp_path / "worker.jsonl"
    monkeypatch.delenv("PYTHONPATH", raising=False)  # the worker sees the fake SDK, no sources
    env = {"PYTHONPATH": str(FAKES), "INF2SERVE_E2E_WORKER_REPORT": str(report),
           "PIP_NO_INDEX": "1",  # the per-model install must need nothing from an index
           "INF2SERVE_FAKE_NEURON_EVENTS": str(tmp_path / "events.jsonl"),
           "INF2SERVE_FAKE_NEURON_DEVICE_DIR": str(tmp_path / "device")}
    run_dir = tmp_path / "run"
    server = serve.start(store, ["tiny-neuron"], run_dir, env=env, python=str(python),
                         ready_timeout_s=150, extra_props=_isolated_props())
    try:
        texts = []
        for prompt in PROMPTS:
            r = post(server, "tiny-neuron", {"prompt": prompt, "max_new_tokens": MAX_NEW_TOKENS,
                                             "temperature": 0.0})
            assert r.status == 200, r.body
            texts.append(r.text)
        workers = [json.loads(line) for line in report.read_text().splitlines()]
        ts_log = (run_dir / "logs" / "ts_log.log").read_text(errors="replace")
    except BaseException:
        print(logs(run_dir))
        raise
    finally:
        serve.stop(run_dir)
    assert "Installed custom pip packages for model tiny-neuron" in ts_log
    assert workers and all(w["version"] == version for w in workers), workers
    assert all(Path(w["file"]).resolve().is_relative_to(overlay.resolve()) for w in workers)
    assert texts == _reference(tiny_checkpoint)
    assert any(t.strip() for t in texts)
