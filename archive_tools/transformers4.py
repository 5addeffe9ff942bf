"""`validate --checkpoint` of a Neuron backend: load under the SDKs' transformers 4.x.

`package` and `validate` load the tokenizer and config.json with this process's
transformers, the serving one for the torch backend; a Neuron worker runs the SDK's 4.x
(4.36 to 4.57). The JSON rules of handlers/transformers4_rules.py catch what is known to
fail there; `validate` also loads the files under each transformers 4.x it finds
(INF2SERVE_TF4_OVERLAYS, os.pathsep-separated `pip install --target` directories, else
`make overlays`' .venv/overlays/transformers-4.*), in a subprocess with that directory
first on PYTHONPATH, as a worker on that SDK would load them. The subprocesses run side by
side: each spends seconds importing its transformers, and a validate waits for the slowest
rather than for their sum.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from handlers.errors import Inf2ServeError
from handlers.transformers4_rules import PREPARE_FIX

OVERLAYS_ENV = "INF2SERVE_TF4_OVERLAYS"
#: seconds for one subprocess to import transformers and load a tokenizer
LOAD_TIMEOUT_S = 300


def overlays() -> list[Path]:
    """Directories holding a transformers 4.x to load checkpoints under."""
    listed = os.environ.get(OVERLAYS_ENV)
    if listed is not None:
        dirs = [Path(p) for p in listed.split(os.pathsep) if p]
    else:
        dirs = sorted((Path(sys.prefix) / "overlays").glob("transformers-4.*"))
    return [d for d in dirs if (d / "transformers").is_dir()]


def load_under(overlay: Path, checkpoint: Path) -> dict:
    """{"transformers": version} or {"error": why}: the probe in a subprocess."""
    env = {**os.environ, "PYTHONPATH": str(overlay)}
    try:
        r = subprocess.run([sys.executable, "-m", "archive_tools.transformers4_probe",
                            str(checkpoint.resolve())], env=env, capture_output=True, text=True,
                           timeout=LOAD_TIMEOUT_S)
        return json.loads(r.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return {"error": f"no answer in {LOAD_TIMEOUT_S} s"}
    except (ValueError, IndexError):
        return {"error": " ".join((r.stderr.strip().splitlines() or ["no output"])[-1:])}


def check_loads_under_4x(checkpoint: Path, flag: str = "--checkpoint") -> list[str]:
    """Load under every overlay found; raise on the first that fails. Returns notes.

    An overlay whose transformers predates the checkpoint's family (4.36 and Qwen2) is
    passed over with a note: the SDK lines that ship it cannot serve that family at all
    (handlers/families.py says which can), so only the lines that know it are a worker's.
    None knowing it is a refusal."""
    found = overlays()
    if not found:
        return [f"transformers 4.x (the Neuron SDKs') not found here, so the checkpoint was "
                f"checked by rule only; `make overlays` builds them (or set {OVERLAYS_ENV})"]
    with ThreadPoolExecutor(max_workers=len(found)) as pool:
        results = list(pool.map(lambda overlay: load_under(overlay, checkpoint), found))
    loaded, older, model_type = [], [], None
    for overlay, got in zip(found, results, strict=True):
        if "error" in got:
            raise Inf2ServeError(f"{flag} {checkpoint}: does not load under {overlay.name} "
                                 f"(a Neuron SDK's transformers), as a neuron worker loads it: "
                                 f"{got['error']}; {PREPARE_FIX}")
        if "unknown" in got:
            older.append(got["transformers"])
            model_type = got["unknown"]
        else:
            loaded.append(got["transformers"])
    if not loaded:
        raise Inf2ServeError(f"{flag} {checkpoint}: model_type {model_type!r} is unknown to "
                             f"transformers {', '.join(older)} (the Neuron SDKs' 4.x found "
                             "here), so no neuron worker can load it; serve it with "
                             "handler.backend: torch")
    notes = [f"tokenizer and config.json load under transformers {', '.join(loaded)} (the "
             "Neuron SDKs' 4.x)"]
    if older:
        notes.append(f"transformers {', '.join(older)} predate{'s' if len(older) == 1 else ''}"
                     f" model_type {model_type!r}: the SDK lines that ship "
                     f"{'it' if len(older) == 1 else 'them'} cannot serve this family")
    return notes
