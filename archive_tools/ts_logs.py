"""TorchServe's logs: how they are routed (LOG4J2_XML), and what they say about a worker
that died while loading its model, or a frontend that exited during start-up.

TorchServe 0.12 restarts such a worker for ever (with back-off), and its management API
shows only a worker that is not READY, so `inf2serve serve` reads the logs of its run
directory: ts_log.log says a worker was lost before its model loaded, model_log.log holds
the worker's traceback. Reads start where the logs ended when this run began (TorchServe
appends to earlier runs' logs).
"""

from __future__ import annotations

import re
import time
from collections.abc import Collection
from pathlib import Path

#: a worker that dies before its model is loaded (state WORKER_STARTED, not yet
#: WORKER_MODEL_LOADED): pytorch/serve@v0.12.0 frontend/server/src/main/java/org/pytorch/
#: serve/wlm/AsyncWorkerThread.java:195 and WorkerThread.java:412 log "{port} Worker
#: disconnected. {state}"
DIED_AT_LOAD = "Worker disconnected. WORKER_STARTED"
#: the worker's own last words, then its traceback (ts/model_service_worker.py:311): any
#: exception before or while loading (a socket it cannot bind, the handler's refusal)
WORKER_DIED = "Backend worker process died."
#: the frontend restarts a worker that died or never connected (WorkerThread.java retry():
#: "Retry worker: {port} in {n} seconds."), for ever, with back-off
RETRY = "Retry worker: "
#: restarts of one model's workers before it was READY after which `serve` gives up,
#: whatever the reason (a worker killed before it could write a traceback, say)
MAX_LOAD_RETRIES = 3
#: the worker thread of a ts_log line, or the worker of a model_log line: W-9000-tiny_1.0
WORKER_OF = re.compile(r"\bW-\d+-(\S+?)_[^_\s]+(?:-std(?:out|err))?\s")
ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\w*\b")
#: the frontend's stdout (`torchserve --start` hands it down from `inf2serve serve`): where
#: a start-up exception goes, never to ts_log (ModelServer.java:112-117, printStackTrace)
FRONTEND_OUT = "torchserve.out"
#: a bind that failed (REST or gRPC port), the one start-up failure a retry can cure
PORT_TAKEN = "Address already in use"


#: TorchServe 0.12's log4j2.xml (frontend/server/src/main/resources/log4j2.xml) with each line
#: written once. The stock file sends the `org.pytorch.serve` logger to ts_log and, through
#: Root (additive), to ts_log again and to stdout, and MODEL_LOG / ACCESS_LOG lines to ts_log
#: as well: every ts_log line twice, ~5.5 KB per request. Here every named logger has its one
#: file (additivity="false"); stdout (`torchserve.out` under `inf2serve serve`) gets warnings,
#: and ModelServer's start-up and "Torchserve stopped." lines, which frontend_exit looks for.
#: Per request that leaves the access log line and next to nothing in ts_log: DEBUG lines
#: ("Flushing req.cmd PREDICT ...") are off, and so are two INFO lines of no use to a reader:
#: WorkerLifeCycle's echo of every `[METRICS]` line a worker prints ("result=[METRICS]...", a
#: dozen per metrics flush; the metrics still reach /metrics) and AsyncBatchAggregator's
#: "Getting requests from model: ...Model@1a2b3c" at every poll. Appender names, patterns
#: and rolling policies are the stock ones; LOG_LOCATION / METRICS_LOCATION work as there.
LOG4J2_XML = """<?xml version="1.0" encoding="UTF-8"?>
<!-- written by inf2serve (archive_tools/ts_logs.py): TorchServe's log4j2.xml, each line once -->
<Configuration>
  <Appenders>
    <Console name="STDOUT" target="SYSTEM_OUT">
      <PatternLayout pattern="%d{ISO8601} [%-5p] %t %c - %m%n"/>
    </Console>
{appenders}  </Appenders>
  <Loggers>
    <Logger name="ACCESS_LOG" level="info" additivity="false">
      <AppenderRef ref="access_log"/>
    </Logger>
    <Logger name="MODEL_LOG" level="all" additivity="false">
      <AppenderRef ref="model_log"/>
    </Logger>
    <Logger name="MODEL_METRICS" level="all" additivity="false">
      <AppenderRef ref="model_metrics"/>
    </Logger>
    <Logger name="TS_METRICS" level="all" additivity="false">
      <AppenderRef ref="ts_metrics"/>
    </Logger>
    <Logger name="org.pytorch.serve" level="info" additivity="false">
      <AppenderRef ref="ts_log"/>
      <AppenderRef ref="STDOUT" level="warn"/>
    </Logger>
    <Logger name="org.pytorch.serve.ModelServer" level="info" additivity="false">
      <AppenderRef ref="ts_log"/>
      <AppenderRef ref="STDOUT"/>
    </Logger>
    <Logger name="org.pytorch.serve.wlm.WorkerLifeCycle" level="warn" additivity="false">
      <AppenderRef ref="ts_log"/>
      <AppenderRef ref="STDOUT"/>
    </Logger>
    <Logger name="org.pytorch.serve.wlm.AsyncBatchAggregator" level="warn" additivity="false">
      <AppenderRef ref="ts_log"/>
      <AppenderRef ref="STDOUT"/>
    </Logger>
    <Logger name="io.netty" level="error"/>
    <Logger name="org.apache" level="off"/>
    <Root level="info">
      <AppenderRef ref="ts_log"/>
      <AppenderRef ref="STDOUT" level="warn"/>
    </Root>
  </Loggers>
</Configuration>
"""
_APPENDER = """    <RollingFile name="{name}" fileName="${{env:{env}:-logs}}/{name}.log"
                 filePattern="${{env:{env}:-logs}}/{name}.%d{{dd-MMM}}.log.gz">
      <PatternLayout pattern="{pattern}"/>
      <Policies>
        <SizeBasedTriggeringPolicy size="100 MB"/>
        <TimeBasedTriggeringPolicy/>
      </Policies>
      <DefaultRolloverStrategy max="5"/>
    </RollingFile>
"""
_FULL, _SHORT = "%d{ISO8601} [%-5p] %t %c - %m%n", "%d{ISO8601} - %m%n"
_FILES = (("access_log", "LOG_LOCATION", _SHORT), ("model_log", "LOG_LOCATION", _FULL),
          ("model_metrics", "METRICS_LOCATION", _SHORT), ("ts_log", "LOG_LOCATION", _FULL),
          ("ts_metrics", "METRICS_LOCATION", _SHORT))
LOG_CONFIG = "log4j2.xml"


def log4j2_xml() -> str:
    appenders = "".join(_APPENDER.format(name=n, env=e, pattern=p) for n, e, p in _FILES)
    return LOG4J2_XML.replace("{appenders}", appenders)


def write_log_config(directory: Path) -> Path:
    """Write log4j2.xml into `directory` (for `torchserve --log-config`, or the
    LOG4J_CONFIGURATION_FILE environment variable of a stock `torchserve` command)."""
    path = Path(directory) / LOG_CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(log4j2_xml())
    return path


def last_worker_line(run_dir: Path, model: str, sizes: dict[str, int],
                     tail_bytes: int = 65536) -> str:
    """The last line a worker of `model` wrote to model_log since `sizes` (its tail only):
    what `serve` shows while the model loads or compiles."""
    path = run_dir / "logs" / "model_log.log"
    if not path.exists():
        return ""
    start = max(sizes.get("model_log.log", 0), path.stat().st_size - tail_bytes)
    with open(path, "rb") as f:
        f.seek(start)
        text = f.read().decode("utf-8", errors="replace")
    marker = re.compile(rf"W-\d+-{re.escape(model)}_[^_\s]+-std(?:out|err) MODEL_LOG - (.*)")
    found = [m.group(1).strip() for m in map(marker.search, text.splitlines()) if m]
    return next((line for line in reversed(found) if line), "")


def _path(run_dir: Path, name: str) -> Path:
    return run_dir / name if name == FRONTEND_OUT else run_dir / "logs" / name


def log_sizes(run_dir: Path) -> dict[str, int]:
    """Where each log ends now: TorchServe appends to the logs of earlier runs."""
    return {n: _path(run_dir, n).stat().st_size if _path(run_dir, n).exists() else 0
            for n in ("ts_log.log", "model_log.log", FRONTEND_OUT)}


def log_since(run_dir: Path, name: str, sizes: dict[str, int]) -> str:
    path = _path(run_dir, name)
    if not path.exists():
        return ""
    with open(path, "rb") as f:
        f.seek(sizes.get(name, 0))
        return f.read().decode("utf-8", errors="replace")


class LoadWatch:
    """What TorchServe logged since `sizes`, read a poll at a time (only new whole lines):
    has a worker of a model that is not READY yet died while loading? Yes at the first
    worker lost before its model loaded (ts_log), the first worker traceback (model_log:
    a handler that refused, a socket it could not bind), or the MAX_LOAD_RETRIES-th
    restart of that model's workers, whatever the reason."""

    def __init__(self, run_dir: Path, sizes: dict[str, int]) -> None:
        self.run_dir, self.offsets = run_dir, dict(sizes)
        self.retries: dict[str, int] = {}

    def _new_lines(self, name: str) -> list[str]:
        path = self.run_dir / "logs" / name
        if not path.exists():
            return []
        with open(path, "rb") as f:
            f.seek(self.offsets.get(name, 0))
            new = f.read()
        whole = new[:new.rfind(b"\n") + 1]
        self.offsets[name] = self.offsets.get(name, 0) + len(whole)
        return whole.decode("utf-8", errors="replace").splitlines()

    def died(self, pending: Collection[str]) -> bool:
        died = False
        for line in self._new_lines("ts_log.log"):
            died |= DIED_AT_LOAD in line
            model = _model_of(line)
            if RETRY in line and model in pending:
                self.retries[model] = self.retries.get(model, 0) + 1
                died |= self.retries[model] >= MAX_LOAD_RETRIES
        for line in self._new_lines("model_log.log"):
            died |= WORKER_DIED in line and _model_of(line) in pending
        return died


def _model_of(line: str) -> str | None:
    m = WORKER_OF.search(line)
    return m.group(1) if m else None


def settle(path: Path, timeout_s: float = 5) -> None:
    """Wait until `path` stops growing: the frontend logs the worker's loss while it may
    still be copying the worker's last stdout lines (the traceback) into model_log."""
    deadline, size = time.monotonic() + timeout_s, -1
    while time.monotonic() < deadline and path.exists() and path.stat().st_size != size:
        size = path.stat().st_size
        time.sleep(0.5)


def load_failure(run_dir: Path, sizes: dict[str, int],
                 archives: dict[str, Path] | None = None) -> str | None:
    """Why a worker died while loading its model (since `sizes`), or None if none did.

    TorchServe restarts such a worker for ever (with back-off), so waiting for READY would
    last until the timeout; its model_log holds the traceback that says why, else ts_log
    the frontend's error. `archives` (model -> archive in the store): paths in TorchServe's
    temp copy of an archive are named by the archive instead."""
    ts_log = log_since(run_dir, "ts_log.log", sizes)
    model_log = log_since(run_dir, "model_log.log", sizes)
    if not any(mark in ts_log for mark in (DIED_AT_LOAD, RETRY)) and WORKER_DIED not in model_log:
        return None
    died_models = re.findall(rf"W-\d+-(\S+?)_[^_\s]+-stdout MODEL_LOG - {re.escape(WORKER_DIED)}",
                             model_log)
    retried = [_model_of(line) for line in ts_log.splitlines() if RETRY in line]
    models = sorted(set(died_models) or {m for m in retried if m})
    lines = [line.split(" MODEL_LOG - ", 1)[-1] for line in model_log.splitlines()]
    died = [i for i, line in enumerate(lines) if line.strip() == WORKER_DIED]
    why = [line for line in (lines[died[-1] + 1:] if died else lines[-40:]) if line.strip()]
    errors = [line for line in why if ERROR_LINE.match(line)]
    frontend = [line.split(" - ", 1)[-1] for line in ts_log.splitlines()
                if "[ERROR]" in line or line.startswith("org.pytorch.serve")]
    if errors:
        summary = errors[-1]
    elif frontend:
        summary = f"{frontend[-1]} (the frontend's words; the worker wrote no traceback)"
        why = why or frontend[-10:]
    else:
        summary = "(no Python traceback: killed, or out of memory?)"
    who = f"model {', '.join(models)}: a" if models else "a"
    text = (f"{who} worker died while loading the model: {summary}\n"
            f"TorchServe would restart it for ever, so serve stops here. The worker's log "
            f"({run_dir / 'logs' / 'model_log.log'}):\n  " + "\n  ".join(why[-25:]))
    if archives and len(models) == 1 and models[0] in archives:
        text = store_paths(text, archives[models[0]], temp_dirs(run_dir))
    return text


#: TorchServe's copy of an archive: java.io.tmpdir/models/<32 hex> (ModelArchive.java
#: createTempDir), a .mar unpacked there, a folder linked there under its own name
_MODEL_COPY = r"/models/[0-9a-f]{32}"


#: in a run directory: the short path `serve` gives TorchServe for RUN_DIR/tmp (serve.py)
TMP_LINK_FILE = "tmp_link"


def temp_dirs(run_dir: Path) -> list[str]:
    """The frontend's java.io.tmpdir as paths may spell it: the run directory's tmp, and
    the short link to it that `serve` hands TorchServe (TMP_LINK_FILE)."""
    out = [str(run_dir / "tmp")]
    link = run_dir / TMP_LINK_FILE
    if link.is_file():
        out.append(link.read_text().strip())
    return out


def store_paths(text: str, archive: Path, tmp_dirs: list[str]) -> str:
    """`text` with paths inside TorchServe's temp copy of `archive` named by the archive in
    the store: a folder's path as it is there, a .mar's or .tar.gz's member as ARCHIVE:member."""
    folder = archive.is_dir()
    for tmp in sorted(tmp_dirs, key=len, reverse=True):
        copy = re.escape(tmp) + _MODEL_COPY
        if folder:
            text = re.sub(copy + "/" + re.escape(archive.name) + r"(?=/|\b)", str(archive), text)
        else:
            text = re.sub(copy + "/", f"{archive}:", text)
    return text


def frontend_exit(run_dir: Path, sizes: dict[str, int]) -> str:
    """What the frontend printed, since `sizes`, after its log's last words (ModelServer.java:
    138-140 "Torchserve stopped.", then main's printStackTrace), without the Java stack
    frames: the exception and its causes."""
    lines = log_since(run_dir, FRONTEND_OUT, sizes).splitlines()
    last = max((i for i, line in enumerate(lines) if "Torchserve stopped." in line), default=-1)
    tail = lines[last + 1:] if last >= 0 else lines[-40:]
    return "\n".join(line for line in tail if line.strip() and not line.startswith("\tat ")
                     and not line.lstrip().startswith("... "))
