"""Run a stock TorchServe with secure defaults: start it, wait until READY, stop it.

Secure defaults: bind to 127.0.0.1, token auth on, model management API off
(models are loaded at start-up with --models), startup timeout sized for Neuron
compilation. Each server lives in a run directory holding its config.properties,
log4j2.xml (each log line once: archive_tools/ts_logs.py), key_file.json (TorchServe
writes it to its working directory), logs and pid file (TorchServe keeps the pid under
$TMPDIR, so each run directory gets its own). While workers load (or compile, on Inf2)
`serve` says so every PROGRESS_EVERY_S per model, with the log to watch; at the end it
names every model it serves with its URLs.
The frontend JVM gets bounded memory (archive_tools/jvm_options.py: fixed, pre-touched heap,
bounded metaspace, code cache and direct buffers) through config.properties' `vmargs`;
`--frontend-heap-mb` sizes its heap.
The same functions start the server for `make demo` and for the end-to-end tests; the
commands that call them, and what `serve` prints, are archive_tools/serve_cmd.py.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from archive_tools import neuron_monitor as neuron_monitor_module
from archive_tools import openai_router, pids, ts_logs
from archive_tools.jvm_options import FrontendMemory, merge_vmargs
from archive_tools.ports import free_port
from archive_tools.short_tmp import drop_short_tmp, short_tmp
from archive_tools.ts_logs import FRONTEND_OUT, LoadWatch, load_failure, log_sizes, settle
from handlers.errors import Inf2ServeError
from handlers.telemetry.recorder import METRICS_DIR_ENV

DEFAULT_RUN_DIR = Path(".serve")
#: minutes a token lasts (TorchServe's token_expiration_min, 60 by default: ConfigManager.java
#: getTimeToExpiration); a working day for a local server, and `inf2serve token` renews it
TOKEN_EXPIRY_MIN = 720
#: starts tried when a picked port was taken before TorchServe bound it
START_ATTEMPTS = 3
#: seconds between the progress lines of a model whose workers are not READY yet
PROGRESS_EVERY_S = 10.0
#: what the model store must hold for `serve` to find a model (package.FORMATS' files)
ARCHIVE_SUFFIXES = (".mar", ".tar.gz")


@dataclass(frozen=True)
class Server:
    run_dir: Path
    inference_url: str
    management_url: str
    metrics_url: str
    inference_token: str
    management_token: str
    pid: int
    models: tuple[str, ...] = ()  # the models it serves, in --models order
    openai_url: str = ""  # one OpenAI base URL for all of them (archive_tools/openai_router)
    #: the one Prometheus scrape target: the router's /metrics (docs/monitoring.md)
    scrape_url: str = ""

    def curl_example(self, model: str, prompt: str = "Once upon a time") -> str:
        body = json.dumps({"prompt": prompt, "max_new_tokens": 32})
        return (f"curl -sN -H 'Authorization: Bearer {self.inference_token}' "
                f"-H 'Content-Type: application/json' "
                f"{self.inference_url}/predictions/{model} -d '{body}'")


class PortTaken(Inf2ServeError):
    """A port picked for this server was bound by someone else before TorchServe bound it."""


def write_config_properties(run_dir: Path, model_store: Path, ports: tuple[int, ...],
                            workers: int = 1, extra: dict[str, str] | None = None,
                            frontend: FrontendMemory | None = None,
                            native_memory_tracking: bool = False) -> Path:
    """config.properties of one server. `vmargs` bounds the frontend JVM's memory
    (`frontend`, default FrontendMemory()); a `vmargs` in `extra` goes after ours rather
    than replacing them, so a caller's flag wins (HotSpot takes the last) and the bounds it
    does not name stay."""
    inf, mgmt, metrics, grpc_inf, grpc_mgmt = ports
    extra = dict(extra or {})
    ours = (frontend or FrontendMemory()).vmargs(native_memory_tracking=native_memory_tracking)
    props = {
        # every port of its own, so several servers (demo, tests) can run side by side
        "grpc_inference_port": str(grpc_inf),
        "grpc_management_port": str(grpc_mgmt),
        "inference_address": f"http://127.0.0.1:{inf}",
        "management_address": f"http://127.0.0.1:{mgmt}",
        "metrics_address": f"http://127.0.0.1:{metrics}",
        "model_store": str(model_store.resolve()),
        "enable_model_api": "false",
        "disable_token_authorization": "false",
        "install_py_dep_per_model": "false",
        "default_workers_per_model": str(workers),
        "token_expiration_min": str(TOKEN_EXPIRY_MIN),
        "default_response_timeout": "600",
        "metrics_mode": "prometheus",
        "model_metrics_auto_detect": "true",  # export the handler's TTFT / tokens / queue time
        "enable_envvars_config": "false",
        "vmargs": merge_vmargs(ours, extra.pop("vmargs", None)),
    }
    props.update(extra)
    path = run_dir / "config.properties"
    path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
    return path


def _server_env(run_dir: Path, env: dict[str, str] | None) -> dict[str, str]:
    out = dict(os.environ)
    out.update(env or {})
    tmp = str(short_tmp(run_dir))
    out["TMPDIR"] = tmp  # TorchServe's pid file (and the workers' temp files) live here
    out["TEMP"] = tmp  # -> java.io.tmpdir: worker sockets and unpacked archives
    out["LOG_LOCATION"] = str(run_dir / "logs")
    out["METRICS_LOCATION"] = str(run_dir / "logs")
    return out


def _torchserve_bin(python: str | None) -> str:
    if python:
        return str(Path(python).parent / "torchserve")
    found = Path(sys.executable).parent / "torchserve"
    return str(found) if found.exists() else (shutil.which("torchserve") or "torchserve")


def read_tokens(run_dir: Path, timeout_s: float = 60) -> tuple[str, str]:
    path = run_dir / "key_file.json"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            keys = json.loads(path.read_text())
            return keys["inference"]["key"], keys["management"]["key"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            time.sleep(0.2)
    raise Inf2ServeError(f"{path} did not appear; see {run_dir / 'logs'}")


def _pid(run_dir: Path) -> int | None:
    try:
        return int((run_dir / "tmp" / ".model_server.pid").read_text().strip())
    except (OSError, ValueError):  # none there, or RUN_DIR is no directory
        return None


def _alive(pid: int | None) -> bool:
    return pids.running(pid)


def log_tail(run_dir: Path, lines: int = 60) -> str:
    out = []
    for name in ("ts_log.log", "model_log.log"):
        p = run_dir / "logs" / name
        if p.exists():
            tail = p.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {p} ---\n" + "\n".join(tail))
    return "\n".join(out)


Progress = Callable[[str], None]


def _progress_line(server: Server, models: list[str], waited_s: float,
                   sizes: dict[str, int] | None) -> str:
    """'llama: loading (23 s) - log: ...' (several models: 'a, b: loading ...'), with the
    last line a worker of the first of them wrote when there is one (on Inf2 that is where
    compilation shows): one line per tick however many models load."""
    log = server.run_dir / "logs" / "model_log.log"
    last, who = "", ""
    for model in models:
        last = ts_logs.last_worker_line(server.run_dir, model, sizes or {})
        if last:
            who = f"{model}: " if len(models) > 1 else ""
            break
    last = f"; last: {who}{last[:100]}{'...' if len(last) > 100 else ''}" if last else ""
    return f"{', '.join(models)}: loading ({waited_s:.0f} s) - log: {log}{last}"


def wait_ready(server: Server, models: list[str], timeout_s: float,
               log_sizes: dict[str, int] | None = None, progress: Progress | None = None,
               progress_every_s: float = PROGRESS_EVERY_S,
               archives: dict[str, Path] | None = None) -> None:
    """Poll the management API until every model has a READY worker; fail at once when a
    worker dies while loading, whatever the reason (TorchServe would retry it until the
    timeout; ts_logs.LoadWatch). `progress` gets a line per model still loading every
    `progress_every_s`, and one when it is READY. `archives` (model -> its archive in the
    store) names files in the failure message by the store's path."""
    headers = {"Authorization": f"Bearer {server.management_token}"}
    started = time.monotonic()
    deadline = started + timeout_s
    pending = list(models)
    watch = LoadWatch(server.run_dir, log_sizes or {})
    next_report = started + progress_every_s
    while pending:
        if progress is not None and time.monotonic() >= next_report:
            progress(_progress_line(server, pending, time.monotonic() - started, log_sizes))
            next_report = time.monotonic() + progress_every_s
        if not _alive(server.pid):
            why = ts_logs.frontend_exit(server.run_dir, log_sizes or {})
            error = PortTaken if ts_logs.PORT_TAKEN in why else Inf2ServeError
            raise error(f"TorchServe exited during start-up: {why or '(no exception printed)'}"
                        f"\n{log_tail(server.run_dir)}")
        if log_sizes is not None and watch.died(pending):
            settle(server.run_dir / "logs" / "model_log.log")
            raise Inf2ServeError(load_failure(server.run_dir, log_sizes, archives)
                                 or "a worker died while loading its model")
        if time.monotonic() > deadline:
            raise Inf2ServeError(f"models {pending} not READY after {timeout_s:.0f}s\n"
                                 f"{log_tail(server.run_dir)}")
        name = pending[0]
        try:
            r = httpx.get(f"{server.management_url}/models/{name}", headers=headers, timeout=5)
            if r.status_code == 400 and "InvalidKeyException" in r.text:
                # the management token expired while the model loads (a long Neuron compile)
                key, _ = fresh_token(server.run_dir, "management")
                headers = {"Authorization": f"Bearer {key}"}
                continue
            workers = r.json()[0].get("workers", []) if r.status_code == 200 else []
            if any(w.get("status") == "READY" for w in workers):
                pending.pop(0)
                if progress is not None:
                    progress(f"{name}: ready ({time.monotonic() - started:.0f} s)")
                continue
        except (httpx.HTTPError, ValueError, IndexError, AttributeError):
            pass
        time.sleep(0.5)


def _model_spec(model_store: Path, model: str) -> str:
    """NAME -> NAME=FILE for the archive of that name in the store (any format)."""
    if "=" in model:
        return model
    for suffix in (".mar", ".tar.gz", ""):
        if (model_store / f"{model}{suffix}").exists():
            return f"{model}={model}{suffix}"
    raise Inf2ServeError(f"--models {model}: no {model}.mar, {model}.tar.gz or {model}/ "
                         f"in {model_store}")


def store_archives(model_store: Path) -> list[str]:
    """The archives of a model store, as NAME=FILE: .mar, .tar.gz and archive folders (what
    `inf2serve package` writes); work dirs and anything else are not models."""
    specs = []
    for p in sorted(model_store.iterdir()):
        if p.name.startswith("."):
            continue
        suffix = next((s for s in ARCHIVE_SUFFIXES if p.name.endswith(s) and p.is_file()), None)
        if suffix is not None:
            specs.append(f"{p.name[:-len(suffix)]}={p.name}")
        elif p.is_dir() and (p / "MAR-INF" / "MANIFEST.json").is_file():
            specs.append(f"{p.name}={p.name}")
    return specs


def _check_archive(model_store: Path, spec: str) -> None:
    """Refuse, before TorchServe starts, an archive it could not open: a failed model load
    at start-up takes the whole server down (a .mar that is no zip, a folder without a
    manifest). What is inside is `inf2serve inspect`'s and the worker's to check."""
    name, _, file = spec.partition("=")
    path = model_store / file
    if "://" in file or not path.exists():  # a URL, or TorchServe's own error names it
        return
    if file.endswith(".mar") and path.is_file() and not zipfile.is_zipfile(path):
        raise Inf2ServeError(f"--models {name}: {path} is not a zip file, so not a .mar "
                             "(damaged, cut short, or another file renamed); package it again "
                             "with `inf2serve package`")
    if file.endswith(".tar.gz") and path.is_file() and not tarfile.is_tarfile(path):
        raise Inf2ServeError(f"--models {name}: {path} is not a readable .tar.gz; package it "
                             "again with `inf2serve package --format tgz`")
    if path.is_dir() and not (path / "MAR-INF" / "MANIFEST.json").is_file():
        raise Inf2ServeError(f"--models {name}: {path}/ has no MAR-INF/MANIFEST.json, so it is "
                             "no archive folder; package it with `inf2serve package --format "
                             "no-archive`")


def start(model_store: Path, models: list[str], run_dir: Path = DEFAULT_RUN_DIR, *,
          workers: int = 1, env: dict[str, str] | None = None, python: str | None = None,
          ready_timeout_s: float = 900, extra_props: dict[str, str] | None = None,
          progress: Progress | None = None, frontend: FrontendMemory | None = None,
          native_memory_tracking: bool = False, openai_port: int | None = None,
          neuron_monitor: bool = False) -> Server:
    """Start TorchServe in the background and wait until `models` are READY (all the store's
    archives when `models` is empty); `progress` gets a line per loading model now and then.
    `frontend` bounds the JVM's memory (default FrontendMemory()); `native_memory_tracking`
    lets `jcmd PID VM.native_memory summary` read it (bench/soak.py). `openai_port` (0: a
    free one) starts the one-base-URL OpenAI router beside it (archive_tools/openai_router),
    whose /metrics is the server's scrape target: the workers' metrics (written to
    RUN_DIR/metrics, emptied here), TorchServe's, and with `neuron_monitor` the device's
    (archive_tools/neuron_monitor)."""
    model_store = Path(model_store)
    if model_store.is_file():
        raise Inf2ServeError(f"--model-store {model_store}: a file, not a directory; pass the "
                             "folder `inf2serve package --out` wrote the archives to")
    if not model_store.is_dir():
        raise Inf2ServeError(f"--model-store {model_store}: no such directory")
    specs = [_model_spec(model_store, m) for m in models] or store_archives(model_store)
    if not specs:
        raise Inf2ServeError(f"--model-store {model_store}: no archives in it (.mar, .tar.gz or "
                             f"archive folders); build one with `inf2serve package --out "
                             f"{model_store} ...`")
    for spec in specs:
        _check_archive(model_store, spec)
    models = [spec.split("=")[0] for spec in specs]
    if shutil.which("java") is None:
        raise Inf2ServeError("java not found; TorchServe needs a Java 17 runtime "
                             "(apt-get install openjdk-17-jre-headless)")
    run_dir = Path(run_dir).resolve()
    if run_dir.exists() and not run_dir.is_dir():
        raise Inf2ServeError(f"--run-dir {run_dir}: not a directory; pass a directory for the "
                             "server's config, keys and logs")
    if _alive(_pid(run_dir)):
        raise Inf2ServeError(f"a TorchServe is already running from {run_dir}; "
                             f"stop it with `inf2serve stop --run-dir {shlex.quote(str(run_dir))}`")
    run_dir.mkdir(parents=True, exist_ok=True)
    if neuron_monitor:
        neuron_monitor_module.find()  # refused in one line before anything starts
    # the workers' metrics (handlers/telemetry); a caller's empty value records none
    env = {METRICS_DIR_ENV: str(_fresh_metrics_dir(run_dir)), **(env or {})}
    launch = (run_dir, model_store, specs, models, workers, env, python, ready_timeout_s,
              extra_props, progress, frontend, native_memory_tracking)
    for _ in range(START_ATTEMPTS - 1):
        try:
            server = _launch(*launch)
            break
        except PortTaken:
            pass
    else:
        server = _launch(*launch)
    if openai_port is None and not neuron_monitor:
        return server
    try:
        sources = [("torchserve", f"{server.metrics_url}/metrics")]
        if neuron_monitor:
            sources.append(("neuron-monitor", neuron_monitor_module.start(run_dir, free_port())))
        if openai_port is not None:
            upstream = openai_router.Upstream(server.inference_url, {
                m: model_version(server, m) for m in server.models})
            openai_url = openai_router.start(
                run_dir, upstream, openai_port or free_port(),
                metrics=openai_router.MetricsSources(env[METRICS_DIR_ENV], tuple(sources)))
            server = replace(server, openai_url=openai_url,
                             scrape_url=openai_url.removesuffix("/v1") + "/metrics")
        _write_public(server)
    except BaseException:
        stop(run_dir)
        raise
    return server


def _launch(run_dir: Path, model_store: Path, specs: list[str], models: list[str], workers: int,
            env: dict[str, str] | None, python: str | None, ready_timeout_s: float,
            extra_props: dict[str, str] | None, progress: Progress | None = None,
            frontend: FrontendMemory | None = None, native_memory_tracking: bool = False
            ) -> Server:
    """One `torchserve --start` on freshly picked ports, waited on until READY; stopped
    again on any failure."""
    (run_dir / "key_file.json").unlink(missing_ok=True)
    sizes = log_sizes(run_dir)
    ports = tuple(free_port() for _ in range(5))
    cfg = write_config_properties(run_dir, model_store, ports, workers, extra_props, frontend,
                                  native_memory_tracking)
    binary = _torchserve_bin(python)
    if shutil.which(binary) is None:
        raise Inf2ServeError(f"{binary}: not found; install TorchServe (`pip install -e "
                             "'.[cpu]'`, or `make install`), or pass the Python that has it")
    cmd = [binary, "--start", "--ncs", "--model-store", str(model_store.resolve()),
           "--ts-config", str(cfg), "--log-config", str(ts_logs.write_log_config(run_dir)),
           "--models", *specs]
    with open(run_dir / FRONTEND_OUT, "ab") as out:
        started = subprocess.run(cmd, cwd=run_dir, env=_server_env(run_dir, env), stdout=out,
                                 stderr=subprocess.STDOUT, timeout=120)
    if started.returncode != 0:
        said = ts_logs.log_since(run_dir, FRONTEND_OUT, sizes).strip().splitlines()[-5:]
        raise Inf2ServeError(f"`torchserve --start` exited with status {started.returncode}: "
                             f"{' / '.join(said) or '(no output)'}; see {run_dir / FRONTEND_OUT}")
    try:
        pid = _pid(run_dir)
        if pid is None:
            raise Inf2ServeError(f"TorchServe wrote no pid file; see {run_dir / FRONTEND_OUT}")
        inference_token, management_token = read_tokens(run_dir)
        server = Server(run_dir, f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}",
                        f"http://127.0.0.1:{ports[2]}", inference_token, management_token, pid,
                        tuple(models))
        _write_public(server)
        archives = {spec.split("=")[0]: model_store / spec.split("=", 1)[1] for spec in specs}
        wait_ready(server, models, ready_timeout_s, sizes, progress, archives=archives)
    except BaseException:
        stop(run_dir)
        raise
    return server


def _fresh_metrics_dir(run_dir: Path) -> Path:
    """RUN_DIR/metrics, empty: the workers' files of an earlier server would add to this
    one's counters."""
    path = run_dir / "metrics"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    return path


def _write_public(server: Server) -> None:
    """RUN_DIR/server.json: addresses only; the tokens stay in TorchServe's key_file.json."""
    public = {k: v if k == "models" else str(v) for k, v in server.__dict__.items()
              if not k.endswith("_token")}
    (server.run_dir / "server.json").write_text(json.dumps(public))


def fresh_token(run_dir: Path = DEFAULT_RUN_DIR, kind: str = "inference") -> tuple[str, str]:
    """A new `kind` token (and its expiry) from the running TorchServe of `run_dir`.

    TorchServe 0.12's token API: the management port's /token?type=inference|management,
    authorized by the key file's "API" key, which never expires; it replaces that token (the
    old one stops working) and rewrites key_file.json (TokenAuthorizationHandler.java:42-56,
    TokenAuthorization.java:74-89,139-193)."""
    run_dir = Path(run_dir).resolve()
    if kind not in ("inference", "management"):
        raise Inf2ServeError(f"--type {kind!r}: choose inference or management")
    try:
        info = json.loads((run_dir / "server.json").read_text())
        api_key = json.loads((run_dir / "key_file.json").read_text())["API"]["key"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise Inf2ServeError(f"no TorchServe started by `inf2serve serve` in {run_dir} "
                             f"({exc}); pass its --run-dir") from exc
    try:
        r = httpx.post(f"{info['management_url']}/token", params={"type": kind},
                       headers={"Authorization": f"Bearer {api_key}"}, timeout=10)
    except httpx.HTTPError as exc:
        raise Inf2ServeError(f"TorchServe at {info['management_url']} did not answer ({exc}); "
                             f"is it running? (inf2serve serve --run-dir "
                             f"{shlex.quote(str(run_dir))})") from exc
    if r.status_code != 200:
        raise Inf2ServeError(f"TorchServe refused a new token: {r.status_code} {r.text.strip()}")
    keys = json.loads((run_dir / "key_file.json").read_text())[kind]
    return keys["key"], keys["expiration time"]


def stop(run_dir: Path = DEFAULT_RUN_DIR, timeout_s: float = 60) -> bool:
    """Stop the TorchServe of `run_dir` and its workers; True if one was running."""
    run_dir = Path(run_dir).resolve()
    if run_dir.exists() and not run_dir.is_dir():
        raise Inf2ServeError(f"--run-dir {run_dir}: not a directory; pass the --run-dir "
                             "`inf2serve serve` was given (default .serve)")
    # every process signalled first, then waited for together: the frontend takes ~2 s
    # (Netty's graceful quiet period) and the others end meanwhile
    helpers = openai_router.terminate(run_dir) + neuron_monitor_module.terminate(run_dir)
    pid = _pid(run_dir)
    was_running = _alive(pid) and pids.terminate(pid)
    if was_running:
        pids.end([pid], timeout_s)
        _kill_workers(run_dir)
        for name in ("key_file.json", "server.json"):
            (run_dir / name).unlink(missing_ok=True)
    pids.end(helpers, 5)
    drop_short_tmp(run_dir)
    return was_running


def _kill_workers(run_dir: Path) -> None:
    """Workers are children of the frontend; make sure none outlives it."""
    try:
        import psutil
    except ImportError:
        return
    for proc in psutil.process_iter(["pid", "environ"]):
        try:
            env = proc.info.get("environ") or {}
        except (psutil.Error, OSError):
            continue
        if env.get("LOG_LOCATION") == str(run_dir / "logs"):
            try:
                proc.kill()
            except psutil.Error:
                pass


def model_version(server: Server, model: str) -> str:
    """The served version (the archive's --version), which OpenAI base URLs carry."""
    try:
        r = httpx.get(f"{server.management_url}/models/{model}", timeout=5,
                      headers={"Authorization": f"Bearer {server.management_token}"})
        return str(r.json()[0]["modelVersion"])
    except (httpx.HTTPError, ValueError, LookupError, TypeError):
        return "1.0"  # torch-model-archiver's default
