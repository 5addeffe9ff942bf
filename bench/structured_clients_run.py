"""LangChain's `with_structured_output` and Instructor, their PyPI packages unmodified,
against the toolkit's demo server: the recorded run behind docs/structured_outputs.md.

It checks that the two libraries agent and extraction code reaches structured outputs
through, only pointed at `inf2serve serve`'s one OpenAI base URL (the router) with the
inference token as their key, get answers they parse into the pydantic model they asked for:

1. builds two random-weight demo models (`inf2serve demo-model`: the tiny Llama, whose
   Llama-2 template has no tool format, and `--arch qwen2`, Qwen2.5's published template,
   whose tool format a forced call is written in) and packages each with
   model_configs/tiny-llama-cpu.yaml, in a temporary directory (or serves `--model-store`);
   starts TorchServe and the router (archive_tools.serve.start);
2. runs bench/structured_clients_cases.py with the clients' own python (their venv; instructor
   pins openai and jiter versions the toolkit's venv does not hold): LangChain
   `ChatOpenAI(...).with_structured_output(Order, method="json_schema", strict=True)`,
   `.invoke`, with `include_raw=True`, and `.stream`, on the Llama; Instructor
   `from_openai(OpenAI(...), mode=Mode.JSON_SCHEMA)` on the Llama and `mode=Mode.TOOLS` (a
   named, forced tool call) on the Qwen2, each with `create_with_completion` and
   `create_partial` (streamed); every case greedy, seeded, max_tokens 200;
3. records per case what the client sent (each request's body, through an httpx event hook
   on the client's own http client), the finish_reason, the parsed object and the verdict,
   and the TorchServe access log's answers over the run.

A case passes when the client returned an `Order` (it parsed and validated the answer
itself) and, where the answer's finish_reason is seen, it is `stop` (json_schema) or
`tool_calls` (a forced call). Result: bench/results/structured_clients/result.json and
result.md. Exit status 1 when any case failed (the work directory is kept then), 2 when the
clients' python is missing. The token goes nowhere but the client process's environment.

The clients are not installed by this script, nor run in CI:

  python3.11 -m venv /tmp/s2/cvenv && /tmp/s2/cvenv/bin/pip install \\
      langchain-openai==1.7.4 instructor==1.17.0
  .venv/bin/python bench/structured_clients_run.py     # -> bench/results/structured_clients/
  .venv/bin/python bench/structured_clients_run.py --clients-python /path/to/bin/python
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CLIENTS_PYTHON = Path("/tmp/s2/cvenv/bin/python")
PINS = "langchain-openai==1.7.4 instructor==1.17.0"
INSTALL_HINT = (f"python3.11 -m venv /tmp/s2/cvenv && /tmp/s2/cvenv/bin/pip install {PINS}")
CASES_SCRIPT = REPO / "bench" / "structured_clients_cases.py"
DEMO_CONFIG = REPO / "model_configs" / "tiny-llama-cpu.yaml"
DEFAULT_OUT = REPO / "bench" / "results" / "structured_clients"
JSON_MODEL = "tiny-llama"  # the name `make demo` serves it under
TOOLS_MODEL = "tiny-qwen2"
SERVER_READY_S = 600
CLIENTS_S = 600
#: the finish_reason a passing case may show, by how it asked for its shape
EXPECTED_FINISH = {"json_schema": "stop", "tools": "tool_calls"}


def say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def build_store(work: Path) -> Path:
    """The two demo models, packaged as `make demo` packages the Llama."""
    from archive_tools.demo_model import build_demo_model
    from archive_tools.package import package

    store = work / "model_store"
    store.mkdir()
    for name, arch in ((JSON_MODEL, "llama"), (TOOLS_MODEL, "qwen2")):
        checkpoint = build_demo_model(work / name, "tiny", seed=0, arch=arch)
        package(DEMO_CONFIG, checkpoint, name, "mar", store, force=True)
    return store


def run_clients(python: Path, server: Any) -> dict[str, Any]:
    env = {**os.environ, "INF2SERVE_BASE_URL": server.openai_url,
           "INF2SERVE_TOKEN": server.inference_token, "INF2SERVE_JSON_MODEL": JSON_MODEL,
           "INF2SERVE_TOOLS_MODEL": TOOLS_MODEL, "PYTHONPATH": ""}
    done = subprocess.run([str(python), str(CASES_SCRIPT)], env=env, capture_output=True,
                          text=True, timeout=CLIENTS_S, cwd=CASES_SCRIPT.parent)
    if done.returncode != 0:
        raise RuntimeError(f"the client script exited {done.returncode}:\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def verdict(case: dict[str, Any]) -> tuple[bool, str]:
    """(passed, why not): the client returned a valid Order, and the finish_reason it saw
    (where the case exposes it) is the one its way of asking ends with."""
    if "expected: 400" in case["case"]:
        error = case.get("server_error") or {}
        if case.get("status") == 400 and error.get("param") == "tool_choice":
            return True, ""
        return False, f"expected a 400 naming tool_choice, got {case.get('status')} " \
                      f"{case['error'] or error}"
    if case["error"]:
        return False, case["error"].splitlines()[0][:300]
    if not (case["is_order"] and case["validates"]):
        return False, "the client returned no valid Order"
    way = "tools" if "TOOLS" in case["case"] else "json_schema"
    reason = case.get("finish_reason")
    if reason is not None and reason != EXPECTED_FINISH[way]:
        return False, f"finish_reason {reason!r}, expected {EXPECTED_FINISH[way]!r}"
    return True, ""


ACCESS_LINE = re.compile(r'^(\S+) - \S+ "(\w+) (\S+) HTTP/[\d.]+" (\d{3})')


def access_log(run_dir: Path) -> dict[str, Any]:
    """TorchServe's answers over the run: counts per path and status, the non-200 lines."""
    path = run_dir / "logs" / "access_log.log"
    counts: dict[str, int] = {}
    non_200: list[str] = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        found = ACCESS_LINE.match(line)
        if not found:
            continue
        key = f"{found.group(2)} {found.group(3)} {found.group(4)}"
        counts[key] = counts.get(key, 0) + 1
        if found.group(4) != "200":
            non_200.append(line)
    return {"answers": counts, "non_200": non_200}


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from archive_tools import serve

    started = time.monotonic()
    store = args.model_store or build_store(work)
    run_dir = work / "run"
    server = None
    try:
        say(f"starting TorchServe and the OpenAI router on {store}")
        server = serve.start(store, [JSON_MODEL, TOOLS_MODEL], run_dir, openai_port=0,
                             ready_timeout_s=SERVER_READY_S)
        server_s = round(time.monotonic() - started, 1)
        say(f"router at {server.openai_url}; running the clients ({args.clients_python})")
        mark = time.monotonic()
        clients = run_clients(args.clients_python, server)
        clients_s = round(time.monotonic() - mark, 1)
        for case in clients["cases"]:
            case["passed"], case["why_not"] = verdict(case)
        result = {
            "what": "LangChain with_structured_output and Instructor (PyPI packages, "
                    "unmodified) against `inf2serve serve`'s OpenAI router: "
                    "bench/structured_clients_run.py",
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "versions": {**clients["versions"],
                         "torchserve": importlib.metadata.version("torchserve"),
                         "llguidance": importlib.metadata.version("llguidance"),
                         "server_python": platform.python_version()},
            "models": {JSON_MODEL: "inf2serve demo-model (tiny, random weights, Llama-2 "
                                   "template: no tool format)",
                       TOOLS_MODEL: "inf2serve demo-model --arch qwen2 (tiny, random "
                                    "weights, Qwen2.5's template: <tool_call> format)"}
            if not args.model_store else str(args.model_store),
            "config": "model_configs/tiny-llama-cpu.yaml",
            "response_model_schema": clients["schema"],
            "cases": clients["cases"],
            "passed": sum(c["passed"] for c in clients["cases"]),
            "failed": sum(not c["passed"] for c in clients["cases"]),
            "torchserve_access_log": access_log(run_dir),
            "phases_s": {"models_and_server_s": server_s, "clients_s": clients_s},
            "load_average_1_5_15": [round(x, 1) for x in os.getloadavg()],
        }
        if server.inference_token in json.dumps(result):  # it must stay out of the record
            raise RuntimeError("the inference token showed up in the result; nothing written")
        return result
    finally:
        if server is not None or run_dir.exists():
            serve.stop(run_dir)


def markdown(result: dict[str, Any]) -> str:
    v = result["versions"]
    lines = [
        "# LangChain and Instructor against the structured outputs (recorded run)",
        "",
        f"{result['date']}; `bench/structured_clients_run.py`; langchain-openai "
        f"{v['langchain-openai']}, langchain-core {v['langchain-core']}, instructor "
        f"{v['instructor']}, openai {v['openai']}, pydantic {v['pydantic']} (their own venv, "
        f"Python {v['python']}); TorchServe {v['torchserve']}, llguidance {v['llguidance']}. "
        f"Random-weight demo models, greedy, max_tokens 200.",
        "",
        f"**{result['passed']} passed, {result['failed']} failed.**",
        "",
        "| client | case | model | finish_reason | sent | parsed | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in result["cases"]:
        sent = "; ".join(sorted({_sent_shape(s["body"]) for s in c["sent"]}))
        parsed = json.dumps(c["parsed"], ensure_ascii=False) if c["parsed"] else "-"
        lines.append(f"| {c['client']} | {c['case']} | {c['model']} | "
                     f"{c.get('finish_reason') or '(not exposed)'} | {sent} | `{parsed}` | "
                     f"{'pass' if c['passed'] else 'FAIL: ' + c['why_not']} |")
    lines += ["", "The requests' bodies, the raw answers and the TorchServe access log are in "
              "result.json.", ""]
    return "\n".join(lines)


def _sent_shape(body: Any) -> str:
    """What asked for the shape, in a few words: response_format's type and strict, or the
    tool_choice."""
    if not isinstance(body, dict):
        return "?"
    parts = []
    if "response_format" in body:
        fmt = body["response_format"]
        strict = (fmt.get("json_schema") or {}).get("strict")
        parts.append(f"response_format {fmt.get('type')}"
                     + (f" strict={strict}" if strict is not None else ""))
    if "tool_choice" in body:
        parts.append(f"tool_choice {json.dumps(body['tool_choice'])}")
    if body.get("stream"):
        parts.append("stream")
    return ", ".join(parts) or "plain"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--clients-python", type=Path, default=DEFAULT_CLIENTS_PYTHON,
                   metavar="PYTHON", help="the python of a venv holding langchain-openai and "
                   f"instructor (default {DEFAULT_CLIENTS_PYTHON})")
    p.add_argument("--model-store", type=Path, default=None,
                   help=f"serve this store (models {JSON_MODEL} and {TOOLS_MODEL}) instead of "
                        "building the demo models")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="where result.json and result.md go (default "
                        "bench/results/structured_clients)")
    p.add_argument("--keep-work", action="store_true",
                   help="keep the work directory (logs, archives) after the run")
    args = p.parse_args(argv)
    if not (args.clients_python.is_file() and os.access(args.clients_python, os.X_OK)):
        print(f"no clients' python at {args.clients_python}; make its venv with:\n  "
              f"{INSTALL_HINT}\nor pass --clients-python PATH", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="structured-clients-run-"))
    started = time.monotonic()
    keep = args.keep_work
    try:
        result = run(args, work)
    except Exception:  # any failure: say what, and keep the logs
        keep = True
        print(f"the run failed: {traceback.format_exc()}\nits logs are kept in {work}",
              file=sys.stderr)
        return 1
    finally:
        if keep:
            say(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    result["wall_time_s"] = round(time.monotonic() - started, 1)
    (args.out / "result.json").write_text(json.dumps(result, indent=2, ensure_ascii=False)
                                          + "\n")
    (args.out / "result.md").write_text(markdown(result))
    for c in result["cases"]:
        say(f"{'pass' if c['passed'] else 'FAIL'}: {c['client']} {c['case']} on {c['model']}"
            f"{'' if c['passed'] else ': ' + c['why_not']}")
    say(f"{result['passed']} passed, {result['failed']} failed; {result['wall_time_s']} s -> "
        f"{args.out / 'result.json'}")
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
