"""`inf2serve chat`: a chat page in the browser, in front of a running server's OpenAI API.

The command finds the servers and the token, checks what it was given, and starts the page:
archive_tools/chat_client.py talks to the servers, archive_tools/chat_page.py is the page
(Gradio, imported only here, when the command runs, so no other command, and not the
runtime, needs the `chat` extra).

Where it talks to: by default the server `inf2serve serve` started from --run-dir (its
server.json names the inference URL and the models; each model's OpenAI base URL is
/predictions/{model}/{version}/v1, with the version from the management API), or any
OpenAI base URLs given with --url. The token comes from --token, --token-file, or the run
directory's key_file.json, and stays in this process: the page's HTML and config hold the
model names, base URLs and sampling settings only, and nothing printed names the token.
The page binds 127.0.0.1 unless --host says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

from archive_tools import serve
from archive_tools.chat_client import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TIMEOUT_S,
    DEFAULT_TOP_P,
    ChatBackend,
    ChatError,
    Sampling,
    Token,
    read_key_file,
)
from archive_tools.ports import free_port

#: Gradio's own default port, used when free and no --port is given
DEFAULT_PORT = 7860


def _check_url(url: str) -> str:
    """An http(s) URL, refused here in one line: the OpenAI client would only fail on the
    first message, in the page, where a typo on the command line is harder to see."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ChatError(f"--url {url}: not an http(s) URL; pass an OpenAI base URL such as "
                        "http://127.0.0.1:8080/predictions/tiny-llama/1.0/v1")
    return url.rstrip("/")


def served_base_urls(run_dir: Path) -> list[str]:
    """The OpenAI base URL of every model the `inf2serve serve` of `run_dir` serves: its one
    base URL for all of them (archive_tools/openai_router.py) when it runs one -- through it,
    the stop button also frees the reply's slot at the model -- else each model's own.

    What `serve` itself prints: server.json has the inference URL and the models (the
    tokens stay in TorchServe's key_file.json), the version in each URL comes from the
    management API the way `serve` asks for it (archive_tools/serve.py), since TorchServe
    routes /predictions/NAME/VERSION/ only for the version it serves."""
    run_dir = Path(run_dir).resolve()
    if run_dir.exists() and not run_dir.is_dir():
        raise ChatError(f"--run-dir {run_dir}: not a directory; pass the --run-dir "
                        "`inf2serve serve` was given (default .serve), or --url")
    try:
        info = json.loads((run_dir / "server.json").read_text("utf-8"))
        keys = json.loads((run_dir / "key_file.json").read_text("utf-8"))
        server = serve.Server(run_dir, info["inference_url"], info["management_url"],
                              info["metrics_url"], keys["inference"]["key"],
                              keys["management"]["key"], int(info["pid"]),
                              tuple(info["models"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ChatError(f"no server started by `inf2serve serve` in {run_dir} ({exc}); start "
                        "one (`make demo`, or `inf2serve serve --model-store ...`), pass its "
                        "--run-dir, or pass --url") from exc
    if not serve._alive(server.pid):
        raise ChatError(f"the TorchServe of {run_dir} is not running (pid {server.pid}); "
                        f"start it again with `inf2serve serve --run-dir {run_dir} ...`")
    if info.get("openai_url"):
        return [str(info["openai_url"])]
    return [f"{server.inference_url}/predictions/{name}/{serve.model_version(server, name)}/v1"
            for name in server.models]


def _pick_port(host: str, port: int | None) -> int:
    """--port when free (refused in one line when not), else Gradio's 7860 or any free one."""
    def free(p: int) -> bool:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            try:
                s.bind((host, p))
            except OSError:
                return False
            return True

    if port is not None:
        if not 0 < port < 65536:
            raise ChatError(f"--port {port}: not a port number (1-65535)")
        if not free(port):
            raise ChatError(f"--port {port}: in use on {host}; pass another, or leave --port "
                            "out for a free one")
        return port
    return DEFAULT_PORT if free(DEFAULT_PORT) else free_port()


def _resolve(args: argparse.Namespace) -> tuple[list[str], Token]:
    """(base URLs, token) from the command line, the running server filling the gaps."""
    run_dir = Path(args.run_dir).resolve()
    if args.token and args.token_file:
        raise ChatError("pass --token or --token-file, not both")
    urls = [_check_url(u) for u in args.url or []]
    if not urls:
        urls = served_base_urls(run_dir)
    if args.token:
        return urls, Token(value=args.token)
    if args.token_file:
        path = Path(args.token_file)
        read_key_file(path)  # refused now, in one line, rather than on the first message
        return urls, Token(key_file=path)
    if (run_dir / "key_file.json").is_file():
        read_key_file(run_dir / "key_file.json")
        return urls, Token(key_file=run_dir / "key_file.json", run_dir=run_dir)
    return urls, Token()  # a server without token auth


def _check_sampling(args: argparse.Namespace) -> Sampling:
    """The page's starting settings, in the ranges of its sliders (and of the server)."""
    if not 0 <= args.temperature <= 2:
        raise ChatError(f"--temperature {args.temperature}: pass 0 (greedy) to 2")
    if not 0 < args.top_p <= 1:
        raise ChatError(f"--top-p {args.top_p}: pass a value in (0, 1]")
    if args.max_tokens < 1:
        raise ChatError(f"--max-tokens {args.max_tokens}: pass 1 or more")
    if args.timeout <= 0:
        raise ChatError(f"--timeout {args.timeout}: pass seconds, more than 0")
    return Sampling(args.temperature, args.top_p, args.max_tokens)


def _chat(args: argparse.Namespace) -> int:
    """Check everything that can be checked before Gradio's import (seconds), list the
    models once (a failure is printed and shown in the page, which lists them again on
    every load), start the page and wait; Ctrl-C or SIGTERM closes it."""
    sampling = _check_sampling(args)
    urls, token = _resolve(args)
    port = _pick_port(args.host, args.port)
    # no calls home from the page's server (analytics, version checks); set before import
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        from archive_tools import chat_page
    except ImportError as exc:
        raise ChatError(f"the chat page needs the `chat` extra ({exc.name} is missing): pip "
                        "install 'inf2serve[chat]' (make install installs it)") from exc
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:  # unless --debug
        for name in ("httpx", "httpx2", "openai"):  # a line per request is noise here
            logging.getLogger(name).setLevel(logging.WARNING)
    backend = ChatBackend(urls, token, args.timeout)
    listing = asyncio.run(backend.list_models())
    if args.model and args.model not in listing.labels():
        raise ChatError(f"--model {args.model}: not served at {', '.join(urls)}; these are: "
                        f"{', '.join(listing.labels()) or '(none listed)'}")
    for error in listing.errors:
        print(f"warning: {error}", flush=True)
    page = chat_page.build(backend, listing, sampling, model=args.model, system=args.system)
    try:
        chat_page.launch(page, args.host, port)
    except OSError as exc:  # taken since _pick_port looked (Gradio's import takes seconds)
        raise ChatError(f"the page cannot listen on {args.host}:{port} ({exc}); pass another "
                        "--port") from exc
    try:
        url_host = f"[{args.host}]" if ":" in args.host else args.host
        where = "token from " + (str(token.key_file) if token.key_file else
                                 "--token" if token.value else "nowhere (no auth)")
        print(f"chat page: http://{url_host}:{port}  ({len(listing.models)} model(s): "
              f"{', '.join(listing.labels())}; {where})", flush=True)
        if args.host not in ("127.0.0.1", "localhost", "::1"):
            print(f"warning: --host {args.host}: whoever reaches this address can chat with "
                  "the server's token", flush=True)
        print("Ctrl-C stops it", flush=True)
        while True:
            time.sleep(1)
    finally:
        page.close()


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat", help="a chat page in the browser for a running server (Gradio)",
        description="Start a chat page (Gradio) in front of the OpenAI API of the server "
        "`inf2serve serve` started (--run-dir), or of any OpenAI base URLs (--url): streamed "
        "replies, the model's chat template, a system prompt, sampling settings, a stop "
        "button, a model picker when several are served. The page binds 127.0.0.1 and keeps "
        "the token server-side.\n\nexamples:\n  inf2serve chat\n"
        "  inf2serve chat --run-dir .serve --port 7860 --temperature 0\n"
        "  inf2serve chat --url http://127.0.0.1:8080/predictions/tiny-llama/1.0/v1 "
        "--token-file .serve/key_file.json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", action="append", metavar="BASE_URL",
                   help="an OpenAI base URL (repeat for several; default: every model of the "
                   "server of --run-dir)")
    p.add_argument("--run-dir", default=str(serve.DEFAULT_RUN_DIR),
                   help="the run directory of `inf2serve serve` (its URLs and token; default "
                   f"{serve.DEFAULT_RUN_DIR})")
    auth = p.add_argument_group("token (default: the run directory's key_file.json)")
    auth.add_argument("--token", help="bearer token (visible to `ps`: prefer --token-file)")
    auth.add_argument("--token-file", help="TorchServe key_file.json, read for every request")
    p.add_argument("--host", default="127.0.0.1", help="address the page binds (default "
                   "127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, help=f"the page's port (default {DEFAULT_PORT}, or a "
                   "free one when that is taken)")
    p.add_argument("--model", help="the model selected first (its name in the picker)")
    p.add_argument("--system", default="", help="the system prompt the page starts with")
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE,
                   help=f"0 is greedy (default {DEFAULT_TEMPERATURE})")
    p.add_argument("--top-p", type=float, default=DEFAULT_TOP_P,
                   help=f"default {DEFAULT_TOP_P}")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"per reply (default {DEFAULT_MAX_TOKENS}; no more than the model's "
                   "context)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds to wait for each part of a reply (default "
                   f"{DEFAULT_TIMEOUT_S:.0f})")
    p.set_defaults(func=_chat)
