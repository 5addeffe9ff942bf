"""What TorchServe's logs say about a worker that died while loading its model.

TorchServe 0.12 restarts such a worker for ever (with back-off), and its management API
shows only a worker that is not READY, so `inf2serve serve` reads the logs of its run
directory: ts_log.log says a worker was lost before its model loaded, model_log.log holds
the worker's traceback. Reads start where the logs ended when this run began (TorchServe
appends to earlier runs' logs).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

#: a worker that dies before its model is loaded (state WORKER_STARTED, not yet
#: WORKER_MODEL_LOADED): pytorch/serve@v0.12.0 frontend/server/src/main/java/org/pytorch/
#: serve/wlm/AsyncWorkerThread.java:195 and WorkerThread.java:412 log "{port} Worker
#: disconnected. {state}"
DIED_AT_LOAD = "Worker disconnected. WORKER_STARTED"
#: the worker's own last words, then its traceback (ts/model_service_worker.py:311)
WORKER_DIED = "Backend worker process died."
ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\w*\b")


def log_sizes(run_dir: Path) -> dict[str, int]:
    """Where each log ends now: TorchServe appends to the logs of earlier runs."""
    logs = run_dir / "logs"
    return {n: (logs / n).stat().st_size if (logs / n).exists() else 0
            for n in ("ts_log.log", "model_log.log")}


def log_since(run_dir: Path, name: str, sizes: dict[str, int]) -> str:
    path = run_dir / "logs" / name
    if not path.exists():
        return ""
    with open(path, "rb") as f:
        f.seek(sizes.get(name, 0))
        return f.read().decode("utf-8", errors="replace")


def died_at_load(run_dir: Path, scanned: dict[str, int]) -> bool:
    """Whether ts_log's lines since `scanned` (advanced to the last whole line) report a
    worker lost before READY; each poll reads only what is new."""
    path = run_dir / "logs" / "ts_log.log"
    if not path.exists():
        return False
    with open(path, "rb") as f:
        f.seek(scanned.get("ts_log.log", 0))
        new = f.read()
    whole = new[:new.rfind(b"\n") + 1]
    scanned["ts_log.log"] = scanned.get("ts_log.log", 0) + len(whole)
    return DIED_AT_LOAD.encode() in whole


def settle(path: Path, timeout_s: float = 5) -> None:
    """Wait until `path` stops growing: the frontend logs the worker's loss while it may
    still be copying the worker's last stdout lines (the traceback) into model_log."""
    deadline, size = time.monotonic() + timeout_s, -1
    while time.monotonic() < deadline and path.exists() and path.stat().st_size != size:
        size = path.stat().st_size
        time.sleep(0.5)


def load_failure(run_dir: Path, sizes: dict[str, int]) -> str | None:
    """Why a worker died while loading its model (since `sizes`), or None if none did.

    TorchServe restarts such a worker for ever (with back-off), so waiting for READY would
    last until the timeout; its model_log holds the traceback that says why."""
    if DIED_AT_LOAD not in log_since(run_dir, "ts_log.log", sizes):
        return None
    model_log = log_since(run_dir, "model_log.log", sizes)
    models = sorted(set(re.findall(rf"W-\d+-(\S+?)_[^_\s]+-stdout MODEL_LOG - "
                                   rf"{re.escape(WORKER_DIED)}", model_log)))
    lines = [line.split(" MODEL_LOG - ", 1)[-1] for line in model_log.splitlines()]
    died = [i for i, line in enumerate(lines) if line.strip() == WORKER_DIED]
    why = [line for line in (lines[died[-1] + 1:] if died else lines[-40:]) if line.strip()]
    errors = [line for line in why if ERROR_LINE.match(line)]
    summary = errors[-1] if errors else "(no Python traceback: killed, or out of memory?)"
    who = f"model {', '.join(models)}: a" if models else "a"
    return (f"{who} worker died while loading the model: {summary}\n"
            f"TorchServe would restart it for ever, so serve stops here. The worker's log "
            f"({run_dir / 'logs' / 'model_log.log'}):\n  " + "\n  ".join(why[-25:]))
