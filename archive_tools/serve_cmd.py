"""`inf2serve serve`, `token` and `stop`: the commands around archive_tools/serve.py.

serve.py starts, waits on and stops TorchServe (and the OpenAI router beside it); this
module is what a user types and reads: the options, the summary `serve` prints once the
models are READY, and one-line answers for `token` and `stop`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from archive_tools import serve
from archive_tools.jvm_options import DEFAULT_HEAP_MIB, FrontendMemory
from handlers.errors import Inf2ServeError


def _cli_command() -> str:
    """How to call this CLI again from here: `inf2serve` when it is on PATH, else its path
    (quoted for a shell, as every path in a printed command)."""
    if shutil.which("inf2serve"):
        return "inf2serve"
    script = Path(sys.executable).parent / "inf2serve"
    if script.exists():
        return shlex.quote(os.path.relpath(script) if Path.cwd() in script.parents
                           else str(script))
    return f"{shlex.quote(sys.executable)} -m archive_tools.cli"


def describe(server: serve.Server, models: str | Sequence[str], run_dir: str) -> str:
    """What `serve` prints: each model it serves with its URLs (native and OpenAI base URL),
    the other addresses, where the keys and logs are, a curl, how to stop."""
    models = [models] if isinstance(models, str) else list(models)
    model = models[0]
    logs = server.run_dir / "logs"
    urls = []
    for name in models:
        version = serve.model_version(server, name)
        urls += [f"  {name}",
                 f"    inference   {server.inference_url}/predictions/{name}",
                 f"    OpenAI      {server.inference_url}/predictions/{name}/{version}/v1  "
                 "(base_url)"]
    served = f"{len(models)} models" if len(models) > 1 else "1 model"
    if server.openai_url:
        urls.append(f"  OpenAI, every model  {server.openai_url}  (base_url; `model` picks)")
    return "\n".join([
        f"TorchServe is up (127.0.0.1 only, token auth on), serving {served}:",
        *urls,
        f"  management  {server.management_url}  (model API off)",
        f"  metrics     {server.scrape_url}  (Prometheus: every model and worker, vLLM's "
        "names; no token)" if server.scrape_url else
        f"  metrics     {server.metrics_url}/metrics  (Prometheus, no token)",
        f"  tokens      {server.run_dir / 'key_file.json'}  (\"inference\" key for requests)",
        f"  logs        {logs / 'ts_log.log'}, {logs / 'model_log.log'}",
        "try it:",
        "  " + server.curl_example(model),
        f"the token expires in {serve.TOKEN_EXPIRY_MIN // 60} h; a fresh one:",
        f"  {_cli_command()} token --run-dir {shlex.quote(str(run_dir))}",
        "stop it:",
        f"  {_cli_command()} stop --run-dir {shlex.quote(str(run_dir))}",
    ])


def _say(line: str) -> None:
    print(line, flush=True)


def _serve(args: argparse.Namespace) -> int:
    server = serve.start(Path(args.model_store), args.models or [], Path(args.run_dir),
                   workers=args.workers, ready_timeout_s=args.timeout,
                   extra_props={"install_py_dep_per_model": "true"}
                   if args.install_py_dep_per_model else None, progress=_say,
                   frontend=_frontend(args.frontend_heap_mb),
                   openai_port=None if args.openai_port < 0 else args.openai_port,
                   neuron_monitor=args.neuron_monitor)
    print(describe(server, server.models, args.run_dir))
    return 0


def _frontend(heap_mb: int) -> FrontendMemory:
    """--frontend-heap-mb as bounds, refused in one line when too small."""
    try:
        return FrontendMemory(heap_mib=heap_mb)
    except ValueError as exc:
        raise Inf2ServeError(f"--frontend-heap-mb {heap_mb}: {exc}") from exc


def _token(args: argparse.Namespace) -> int:
    key, expires = serve.fresh_token(Path(args.run_dir), args.type)
    print(key if args.quiet else f"new {args.type} token (the previous one no longer works; "
          f"expires {expires}):\n  {key}")
    return 0


def _stop(args: argparse.Namespace) -> int:
    print("TorchServe stopped" if serve.stop(Path(args.run_dir)) else "no TorchServe running")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="start TorchServe on 127.0.0.1 with token auth and print a curl command",
        description="Start TorchServe (127.0.0.1, token auth on, model API off) and wait until "
        "the models are READY.\n\nexamples:\n  inf2serve serve --model-store model_store "
        "--models tiny-llama", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-store", required=True,
                   help="folder of archives (.mar, .tar.gz or folders) `inf2serve package --out` "
                   "wrote")
    p.add_argument("--models", nargs="*", help="NAME or NAME=ARCHIVE (default: all in the store)")
    p.add_argument("--run-dir", default=str(serve.DEFAULT_RUN_DIR),
                   help=f"config, keys and logs (default {serve.DEFAULT_RUN_DIR})")
    p.add_argument("--workers", type=int, default=1,
                   help="workers per model, each with its own copy of the model (default 1)")
    p.add_argument("--timeout", type=float, default=900,
                   help="seconds to wait for every model to be READY (default 900; a first "
                   "Neuron compile can take most of it)")
    p.add_argument("--install-py-dep-per-model", action="store_true",
                   help="let TorchServe pip-install each archive's requirements.txt into its "
                   "model folder at load (install_py_dep_per_model=true; needs network)")
    p.add_argument("--frontend-heap-mb", type=int, default=DEFAULT_HEAP_MIB,
                   help="the frontend JVM's heap, fixed (-Xms = -Xmx) and pre-touched "
                   f"(default {DEFAULT_HEAP_MIB}); metaspace, code cache and direct buffers "
                   "get fixed bounds too (docs/packaging-and-deploying.md)")
    p.add_argument("--openai-port", type=int, default=0, metavar="PORT",
                   help="port of the one OpenAI base URL for every model (GET /v1/models, "
                   "POST /v1/chat/completions routed by `model`; 127.0.0.1, the same token); "
                   "default: a free port, -1: none (and no /metrics under vLLM's names)")
    p.add_argument("--neuron-monitor", action="store_true",
                   help="run AWS's neuron-monitor and its Prometheus exporter (Neuron tools, "
                   "/opt/aws/neuron/bin) beside the server; the router's /metrics then "
                   "carries the device's metrics too (docs/monitoring.md)")
    p.set_defaults(func=_serve)
    t = sub.add_parser(
        "token", help="get a fresh token from a running `inf2serve serve` (tokens expire)",
        description=f"Ask the running TorchServe for a new token (TorchServe's token API, "
        f"authorized by the API key in RUN_DIR/key_file.json). Tokens last "
        f"{serve.TOKEN_EXPIRY_MIN} minutes under `inf2serve serve` (TorchServe's own default: 60); "
        "the new one replaces the old.\n\nexamples:\n  inf2serve token\n"
        "  curl -H \"Authorization: Bearer $(inf2serve token -q)\" ...",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _served_run_dir(t)
    t.add_argument("--type", default="inference", choices=("inference", "management"),
                   help="which token (default inference, the one requests need)")
    t.add_argument("-q", "--quiet", action="store_true", help="print the token only")
    t.set_defaults(func=_token)
    s = sub.add_parser("stop", help="stop a TorchServe started by `inf2serve serve`",
                       description="Stop the TorchServe (and the OpenAI router beside it) that "
                       "`inf2serve serve` started from --run-dir, and its workers.\n\n"
                       "examples:\n  inf2serve stop\n  inf2serve stop --run-dir /srv/run",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _served_run_dir(s)
    s.set_defaults(func=_stop)


def _served_run_dir(parser: argparse.ArgumentParser) -> None:
    """--run-dir of the commands that talk to a running `inf2serve serve` (token, stop)."""
    parser.add_argument("--run-dir", default=str(serve.DEFAULT_RUN_DIR),
                        help=f"the --run-dir `inf2serve serve` was given (default "
                        f"{serve.DEFAULT_RUN_DIR})")
