"""Open WebUI, its PyPI package unmodified, against the toolkit's demo server in a real browser.

The recorded run behind docs/openai.md's "Open WebUI" settings. It checks that Open WebUI,
only pointed at `inf2serve serve`'s one OpenAI base URL (the router, archive_tools/
openai_router.py) with the inference token as its key, lists the model and streams a chat:

1. builds the tiny demo model and its archive in a temporary directory (its default reply
   raised from 32 to 256 tokens, long enough to watch it grow; or serves `--model-store`),
   starts TorchServe and the router (archive_tools.serve.start), then
   Open WebUI with those settings (`OPENAI_SETTINGS`) and what an offline single-user run
   needs (`LOCAL_SETTINGS`), and waits for its /health;
2. drives the page in headless chromium (selenium, Debian's chromium and chromedriver):
   dismisses the "What's New" dialog, reads the model selector's list and picks the model,
   sends a message, records each distinct text the reply shows (a MutationObserver, and
   samples every ~100 ms) until it is complete (it must show in at least two growing
   parts) and takes a screenshot with the sidebar open;
3. sends the same messages straight to the router (greedy, not streamed) and compares the
   answer with what Open WebUI received (its stored message, read through its own API);
4. records what Open WebUI sent upstream (its own debug log, GLOBAL_LOG_LEVEL=DEBUG: the
   request each chat and task gets before its OpenAI router drops `metadata`), which of
   those TorchServe refused and why, the TorchServe access log's non-200 answers, and the
   chat's title.

Result: bench/results/open_webui/result.json and chat.png. Exit status 1 when the model
was not listed or the reply did not stream (or the run failed; its work directory is kept).
Everything started here (TorchServe, router, Open WebUI, chromium) is stopped at the end.
The token goes nowhere but Open WebUI's environment: the result names the settings only.

Open WebUI is not installed by this script, nor run in CI (about 7 GB, ~70 s to start):

  python3.11 -m venv /tmp/owui && /tmp/owui/bin/pip install open-webui==0.12.4
  .venv/bin/python bench/open_webui_run.py                      # -> bench/results/open_webui/
  .venv/bin/python bench/open_webui_run.py --open-webui /path/to/bin/open-webui --keep-work
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import importlib.metadata
import json
import os
import platform
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from archive_tools import serve
from archive_tools.ports import free_port

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OPEN_WEBUI = Path("/tmp/owui/bin/open-webui")
OPEN_WEBUI_PIN = "0.12.4"
INSTALL_HINT = (f"python3.11 -m venv /tmp/owui && /tmp/owui/bin/pip install "
                f"open-webui=={OPEN_WEBUI_PIN}   (about 7 GB)")
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
DEMO_CONFIG = REPO / "model_configs" / "tiny-llama-cpu.yaml"
DEFAULT_OUT = REPO / "bench" / "results" / "open_webui"
MODEL = "tiny-llama"  # the name `make demo` serves it under
PROMPT = "Tell me a story about a cat."
REPLY_TOKENS = 256
WINDOW = (1400, 900)
SERVER_READY_S = 600  # the demo model loads in seconds; a busy 2-core machine needs slack
OPEN_WEBUI_START_S = 600  # ~70 s on an idle machine: migrations, imports, static files
PAGE_S = 120
REPLY_S = 180
TITLE_S = 60
SAMPLE_EVERY_S = 0.1

#: what points Open WebUI at the toolkit: the values are described, never recorded
OPENAI_SETTINGS = {
    "OPENAI_API_BASE_URLS": "the 'OpenAI, every model' URL `inf2serve serve` prints "
                            "(server.json's openai_url), http://127.0.0.1:PORT/v1",
    "OPENAI_API_KEYS": "the inference token (RUN/key_file.json inference.key)",
    "ENABLE_OLLAMA_API": "False",
    "DEFAULT_MODELS": MODEL,
}
#: what this run adds for an offline, single-user, throwaway Open WebUI (nothing the
#: toolkit needs): no login, no downloads, its data in the work directory, its debug log
LOCAL_SETTINGS = {
    "WEBUI_AUTH": "False",
    "OFFLINE_MODE": "true",
    "HF_HUB_OFFLINE": "1",
    "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "False",
    "DATA_DIR": "a temporary directory",
    "WEBUI_SECRET_KEY": "random per run (else Open WebUI writes .webui_secret_key to its cwd)",
    "GLOBAL_LOG_LEVEL": "DEBUG (its log shows each request it sends upstream)",
}

T = TypeVar("T")


def say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def wait_for(what: str, check: Callable[[], T | None], timeout_s: float,
             every_s: float = 0.2) -> T:
    """Poll `check` until it returns something truthy: the pages and servers here have no
    event to wait on, only a state to look at."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(every_s)
    raise RunFailed(f"timed out after {timeout_s:.0f} s waiting for {what}")


class RunFailed(Exception):
    """The run could not get as far as a verdict (a start or a page that never came)."""


# --- the servers ---------------------------------------------------------------------


def build_store(work: Path, model: str, reply_tokens: int) -> Path:
    """The demo's tiny random model, packaged as `make demo` packages it but for the default
    reply length, `reply_tokens` instead of 32: Open WebUI sends no max_tokens, and 32 of
    the tiny model's tokens arrive within ~0.2 s, one or two frames of the page, where 256
    take 0.6-3 s, long enough to watch the reply grow."""
    import yaml

    from archive_tools.demo_model import build_demo_model
    from archive_tools.package import package

    config = yaml.safe_load(DEMO_CONFIG.read_text())
    config["handler"]["defaults"]["max_new_tokens"] = reply_tokens
    config_path = work / DEMO_CONFIG.name
    config_path.write_text(yaml.safe_dump(config))
    checkpoint = build_demo_model(work / "checkpoint", "tiny", seed=0)
    store = work / "model_store"
    store.mkdir()
    package(config_path, checkpoint, model, "mar", store, force=True)
    return store


def open_webui_env(server: serve.Server, data_dir: Path, model: str) -> dict[str, str]:
    """OPENAI_SETTINGS and LOCAL_SETTINGS with their values (the token among them)."""
    values = {
        "OPENAI_API_BASE_URLS": server.openai_url,
        "OPENAI_API_KEYS": server.inference_token,
        "ENABLE_OLLAMA_API": "False",
        "DEFAULT_MODELS": model,
        "WEBUI_AUTH": "False",
        "OFFLINE_MODE": "true",
        "HF_HUB_OFFLINE": "1",
        "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "False",
        "DATA_DIR": str(data_dir),
        "WEBUI_SECRET_KEY": secrets.token_hex(16),
        "GLOBAL_LOG_LEVEL": "DEBUG",
    }
    assert values.keys() == OPENAI_SETTINGS.keys() | LOCAL_SETTINGS.keys()
    return {**os.environ, **values}


@dataclass
class OpenWebUI:
    """A running `open-webui serve`, in its own process group (it is stopped as one)."""

    proc: subprocess.Popen
    url: str
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # uvicorn shuts down on SIGTERM
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def start_open_webui(exe: Path, work: Path, server: serve.Server, model: str) -> OpenWebUI:
    data = work / "open-webui-data"
    data.mkdir()
    port = free_port()
    log = work / "open_webui.log"
    with log.open("w") as out:
        proc = subprocess.Popen([str(exe), "serve", "--host", "127.0.0.1", "--port", str(port)],
                                env=open_webui_env(server, data, model), cwd=work,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return OpenWebUI(proc, f"http://127.0.0.1:{port}", log)


def wait_healthy(webui: OpenWebUI) -> None:
    def healthy() -> bool:
        if webui.proc.poll() is not None:
            tail = webui.log.read_text(errors="replace").splitlines()[-30:]
            raise RunFailed(f"open-webui exited ({webui.proc.returncode}):\n" + "\n".join(tail))
        try:
            return httpx.get(f"{webui.url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for("Open WebUI's /health", healthy, OPEN_WEBUI_START_S, every_s=2)


# --- the page --------------------------------------------------------------------------

#: the last assistant message: its shown text, and whether it is complete (Open WebUI adds
#: the message's action buttons, Regenerate among them, once the reply has ended)
LAST_REPLY_JS = """
const replies = document.querySelectorAll('.chat-assistant');
if (!replies.length) return null;
const last = replies[replies.length - 1];
const body = last.querySelector('#response-content-container');
const item = last.closest('[id^="message-"]');
return {text: body ? body.innerText.trim() : '',
        done: !!(item && item.querySelector('button[aria-label="Regenerate"]'))};
"""

#: every distinct text the last reply shows, recorded as the page changes: the 100 ms samples
#: can miss parts of a short, fast reply (the demo's 32 tokens take under a second)
RECORD_REPLY_JS = """
window.__replyTexts = [];
const record = () => {
  const replies = document.querySelectorAll('.chat-assistant');
  if (!replies.length) return;
  const body = replies[replies.length - 1].querySelector('#response-content-container');
  const text = body ? body.innerText.trim() : '', seen = window.__replyTexts;
  if (text && (!seen.length || seen[seen.length - 1] !== text)) seen.push(text);
};
new MutationObserver(record).observe(document.body,
                                     {subtree: true, childList: true, characterData: true});
"""

#: the chat as Open WebUI stored it (its own API, with the page's session token): the raw
#: reply, before markdown rendering, and the title
STORED_CHAT_JS = """
const done = arguments[arguments.length - 1];
fetch('/api/v1/chats/' + arguments[0], {headers: {Authorization: 'Bearer ' + localStorage.token}})
  .then(r => r.json()).then(done, e => done({error: String(e)}));
"""


def start_browser() -> Any:
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 f"--window-size={WINDOW[0]},{WINDOW[1]}"):
        options.add_argument(flag)
    service = webdriver.ChromeService(executable_path=str(CHROMEDRIVER))
    return webdriver.Chrome(options=options, service=service)


@dataclass
class PageRun:
    """What the page showed."""

    dismissed: str = ""
    models_listed: list[str] = field(default_factory=list)
    picked: str = ""
    texts: list[str] = field(default_factory=list)  # each distinct text the page showed
    sampled: list[str] = field(default_factory=list)  # each distinct one of the 100 ms samples
    first_text_s: float | None = None
    done_s: float | None = None
    chat_id: str = ""
    stored_reply: str | None = None
    stored_title: str | None = None
    title_shown: str = ""


def visible(browser: Any, css: str, by: str = "css selector") -> list[Any]:
    """The displayed elements `css` finds; one the page re-renders meanwhile (Svelte replaces
    nodes as it updates) counts as not there, to be found again on the next poll."""
    from selenium.common.exceptions import StaleElementReferenceException

    out = []
    for element in browser.find_elements(by, css):
        try:
            if element.is_displayed():
                out.append(element)
        except StaleElementReferenceException:
            pass
    return out


def click(browser: Any, what: str, css: str, timeout_s: float, by: str = "css selector") -> str:
    """Click the first displayed element `css` finds once there is one, and return its text;
    found again where the page re-rendered it between the finding and the click."""
    from selenium.common.exceptions import StaleElementReferenceException

    def clicked() -> str | None:
        for element in visible(browser, css, by):
            try:
                text = element.text
                element.click()
                return text or "(no text)"
            except StaleElementReferenceException:
                return None
        return None

    return wait_for(what, clicked, timeout_s)


def dismiss_whats_new(browser: Any) -> str:
    """Open WebUI shows its changelog ("What's New") on a user's first visit; its button
    closes it. Returns the button's text, or "" where there was none."""
    button = "//button[contains(., \"Let's Go\")]"
    try:
        text = click(browser, "the What's New dialog", button, 15, by="xpath")
    except RunFailed:
        return ""
    wait_for("the dialog to close", lambda: not visible(browser, button, by="xpath"), 10)
    return text


LISTED_MODELS_JS = """
return [...document.querySelectorAll('#model-selector-list [role="option"]')]
  .map(o => o.dataset.value);
"""


def pick_model(browser: Any, model: str) -> tuple[list[str], str]:
    """The model selector's list (each option's data-value), and the model it shows as
    selected after clicking `model` in it."""
    click(browser, "the model selector", "#model-selector-model-button", PAGE_S)
    listed = wait_for("the model list", lambda: browser.execute_script(LISTED_MODELS_JS), 30)
    if model in listed:
        click(browser, f"the option {model}",
              f'#model-selector-list [role="option"][data-value="{model}"]', 10)
    selected = wait_for("the selected model", lambda: browser.execute_script(
        "return [...document.querySelectorAll('[aria-label^=\"Selected model:\"]')]"
        ".map(e => e.getAttribute('aria-label'))"), 10)
    return listed, selected[0].removeprefix("Selected model:").strip()


def chat(browser: Any, prompt: str, page: PageRun) -> None:
    """Send `prompt` as a person would (typed, Enter) and record every distinct text the
    reply shows (a MutationObserver) and every distinct one of samples taken each
    SAMPLE_EVERY_S, until Open WebUI marks the reply complete."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.keys import Keys

    def typed() -> bool:
        for box in visible(browser, "#chat-input"):
            try:
                box.click()
                box.send_keys(prompt)
                box.send_keys(Keys.ENTER)
                return True
            except StaleElementReferenceException:
                return False
        return False

    browser.execute_script(RECORD_REPLY_JS)
    wait_for("the chat input", typed, PAGE_S)
    sent = time.monotonic()
    deadline = sent + REPLY_S
    while time.monotonic() < deadline:
        reply = browser.execute_script(LAST_REPLY_JS)
        now = time.monotonic() - sent
        if reply and reply["text"] and (not page.sampled or page.sampled[-1] != reply["text"]):
            page.sampled.append(reply["text"])
            if page.first_text_s is None:
                page.first_text_s = round(now, 2)
        if reply and reply["done"] and page.sampled:
            page.done_s = round(now, 2)
            break
        time.sleep(SAMPLE_EVERY_S)
    else:
        raise RunFailed(f"no complete reply within {REPLY_S} s; shown so far: {page.sampled}")
    page.texts = browser.execute_script("return window.__replyTexts") or []
    match = re.search(r"/c/([0-9a-f-]+)", browser.current_url)
    page.chat_id = match.group(1) if match else ""


def sidebar_title(browser: Any) -> str:
    from selenium.webdriver.common.by import By

    # the title's own element: the item also holds a screen-reader age ("a few seconds ago")
    items = browser.find_elements(By.CSS_SELECTOR, '#sidebar-chat-item div[dir="auto"]')
    return items[0].get_attribute("textContent").strip() if items else ""


def read_stored(browser: Any, page: PageRun) -> None:
    if not page.chat_id:
        return
    stored = browser.execute_async_script(STORED_CHAT_JS, page.chat_id) or {}
    history = (stored.get("chat") or {}).get("history") or {}
    current = (history.get("messages") or {}).get(history.get("currentId") or "", {})
    if current.get("role") == "assistant":
        page.stored_reply = current.get("content")
    page.stored_title = stored.get("title")


def drive_page(browser: Any, url: str, model: str, prompt: str, shot: Path) -> PageRun:
    page = PageRun()
    browser.get(url + "/")
    wait_for("the chat input", lambda: visible(browser, "#chat-input"), PAGE_S)
    page.dismissed = dismiss_whats_new(browser)
    page.models_listed, page.picked = pick_model(browser, model)
    say(f"model selector lists {page.models_listed}; selected {page.picked!r}")
    if model not in page.models_listed:
        browser.save_screenshot(str(shot))
        return page
    chat(browser, prompt, page)
    say(f"reply shown in {len(page.texts)} distinct texts ({len(page.sampled)} in the samples), "
        f"complete after {page.done_s} s")
    # the title comes from a task Open WebUI runs beside and after the reply; "New Chat"
    # until then, the first message where that task fails or answers no JSON title
    try:
        page.title_shown = wait_for("the chat title", lambda: (
            t if (t := sidebar_title(browser)) and t != "New Chat" else None), TITLE_S)
    except RunFailed:
        page.title_shown = sidebar_title(browser)
    read_stored(browser, page)
    if visible(browser, '[aria-label="Open Sidebar"]'):  # show the chat list, with the title
        click(browser, "the sidebar", '[aria-label="Open Sidebar"]', 10)
        time.sleep(1)
    browser.save_screenshot(str(shot))
    return page


# --- what Open WebUI sent --------------------------------------------------------------

LOGGED_REQUEST = re.compile(r"generate_chat_completion: (\{.*\})\s*$")
LOGGED_FAILURE = re.compile(r"Upstream openai-compatible request failed: HTTP (\d+) .*?"
                            r"code=(\S+) message=(.*)$")
TASK_KEY = re.compile(r'JSON format: \{ "(\w+)"')


def _literal(text: str) -> dict[str, Any] | None:
    """A dict from Open WebUI's log: Python's repr, where the tool callables in its metadata
    (`<function ...>`) are the only non-literals."""
    try:
        value = ast.literal_eval(re.sub(r"<[^<>]*>", "None", text))
    except (ValueError, SyntaxError):
        return None
    return value if isinstance(value, dict) else None


def _kind(request: dict[str, Any], prompt: str) -> str:
    """'chat' for the user's message; a task ('title', 'tags', 'follow_ups') by the JSON key
    its prompt asks for."""
    messages = request.get("messages") or []
    last = messages[-1].get("content") if messages else ""
    text = last if isinstance(last, str) else json.dumps(last)
    if text == prompt:
        return "chat"
    task = TASK_KEY.search(text)
    return task.group(1) if task else "other"


def sent_requests(log: Path, prompt: str) -> list[dict[str, Any]]:
    """Each request Open WebUI made to the model, as its debug log shows it (the dict its
    OpenAI router sends after dropping `metadata`), with the upstream refusal it logged.
    Refusals are matched in order to the non-streamed requests before them: Open WebUI runs
    its tasks (title, follow-ups, tags) one after the other."""
    out: list[dict[str, Any]] = []
    for line in log.read_text(errors="replace").splitlines():
        if found := LOGGED_REQUEST.search(line):
            request = _literal(found.group(1))
            if request is None:
                out.append({"kind": "unparsed", "logged_chars": len(found.group(1))})
                continue
            tools = request.get("tools") or []
            messages = request.get("messages") or []
            entry: dict[str, Any] = {
                "kind": _kind(request, prompt),
                "fields": {k: v for k, v in request.items()
                           if k not in ("messages", "metadata", "tools")},
                "messages": [m.get("role") for m in messages],
                "tools": len(tools),
                "tool_names": [t.get("function", {}).get("name") for t in tools],
            }
            if entry["kind"] == "chat":
                entry["sent_messages"] = messages
            out.append(entry)
        elif found := LOGGED_FAILURE.search(line):
            pending = [r for r in out if "status" not in r and r.get("kind") != "unparsed"
                       and not r["fields"].get("stream")]
            if pending:
                pending[0]["status"] = int(found.group(1))
                pending[0]["server_message"] = found.group(3).strip()
    for entry in out:
        entry.setdefault("status", "no failure logged")
    return out


ACCESS_LINE = re.compile(r'^(\S+) - \S+ "(\w+) (\S+) HTTP/[\d.]+" (\d{3})')


def access_log(run_dir: Path, since: str) -> dict[str, Any]:
    """TorchServe's answers from `since` (its timestamp format) on: counts per path and
    status, and the non-200 lines themselves."""
    path = run_dir / "logs" / "access_log.log"
    counts: dict[str, int] = {}
    non_200: list[str] = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        found = ACCESS_LINE.match(line)
        if not found or found.group(1) < since:
            continue
        key = f"{found.group(2)} {found.group(3)} {found.group(4)}"
        counts[key] = counts.get(key, 0) + 1
        if found.group(4) != "200":
            non_200.append(line)
    return {"answers": counts, "non_200": non_200}


def ts_log_problems(run_dir: Path, since: str) -> list[str]:
    path = run_dir / "logs" / "ts_log.log"
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return [line[:300] for line in lines
            if line[:23] >= since and re.search(r"\[(WARN|ERROR)\s*\]", line)][:20]


# --- the run -------------------------------------------------------------------------


def direct_answer(server: serve.Server, model: str, messages: list[dict[str, Any]],
                  sent: dict[str, Any]) -> str:
    """The same messages straight to the router, greedy and whole: the text Open WebUI's
    stream must add up to (the demo's default temperature is 0 too, so equal is expected).
    A token budget Open WebUI sent is sent again; the tools it sent change nothing here (the
    demo's Llama-2 template has no tool format, so `auto` is plain chat)."""
    body: dict[str, Any] = {"model": model, "messages": messages, "temperature": 0,
                            "stream": False}
    for key in ("max_tokens", "max_completion_tokens"):
        if key in sent:
            body[key] = sent[key]
    r = httpx.post(f"{server.openai_url}/chat/completions", json=body, timeout=120,
                   headers={"Authorization": f"Bearer {server.inference_token}"})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def compare(received: str | None, direct: str) -> tuple[bool, str]:
    if received is None:
        return False, "Open WebUI's stored reply could not be read"
    if received == direct:
        return True, ""
    if received.strip() == direct.strip():
        return False, "equal but for leading/trailing whitespace (Open WebUI trims its reply)"
    at = next((i for i, (a, b) in enumerate(zip(received, direct, strict=False)) if a != b),
              min(len(received), len(direct)))
    return False, (f"differ from character {at}: received {received[at:at + 40]!r}, direct "
                   f"{direct[at:at + 40]!r}")


def growing(texts: list[str]) -> bool:
    """At least two texts, the last longer than the first: the reply grew while it streamed.
    Not "each longer than the one before": the page shows rendered markdown, where a marker
    (`*`, `_`, a backtick) is shown until the token closing it arrives, then hidden."""
    return len(texts) >= 2 and len(texts[0]) < len(texts[-1])


def monotonic(texts: list[str]) -> bool:
    """Recorded beside `growing`, to show where markdown made the shown text shrink."""
    lengths = [len(t) for t in texts]
    return lengths == sorted(lengths)


def versions(webui: OpenWebUI, browser: Any) -> dict[str, str]:
    """What ran, as the running programs report it (not the pins): a rerun on other
    versions shows in its result."""
    import selenium

    caps = browser.capabilities
    try:
        open_webui = httpx.get(f"{webui.url}/api/version", timeout=10).json()["version"]
    except (httpx.HTTPError, KeyError, ValueError):
        open_webui = "unknown"
    return {
        "open_webui": open_webui,
        "chromium": caps.get("browserVersion", "unknown"),
        "chromedriver": caps.get("chrome", {}).get("chromedriverVersion", "?").split()[0],
        "selenium": selenium.__version__,
        "torchserve": importlib.metadata.version("torchserve"),
        "python": platform.python_version(),
    }


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One recorded run, as the module docstring says; whatever fails, everything it
    started is stopped in its `finally`."""
    started = time.monotonic()
    phases: dict[str, float] = {}
    store = args.model_store or build_store(work, args.model, args.reply_tokens)
    run_dir = work / "run"
    server = browser = webui = None
    try:
        say(f"starting TorchServe and the OpenAI router on {store}")
        server = serve.start(store, [args.model], run_dir, openai_port=0,
                             ready_timeout_s=SERVER_READY_S)
        phases["model_and_server_s"] = round(time.monotonic() - started, 1)
        say(f"router at {server.openai_url}; starting Open WebUI ({args.open_webui})")
        since = dt.datetime.now().strftime("%Y-%m-%dT%H:%M:%S,%f")[:23]
        mark = time.monotonic()
        webui = start_open_webui(args.open_webui, work, server, args.model)
        wait_healthy(webui)
        phases["open_webui_start_s"] = round(time.monotonic() - mark, 1)
        say(f"Open WebUI up at {webui.url} after {phases['open_webui_start_s']} s")
        mark = time.monotonic()
        browser = start_browser()
        shot = work / "chat.png"
        page = drive_page(browser, webui.url, args.model, args.prompt, shot)
        phases["page_s"] = round(time.monotonic() - mark, 1)
        found_versions = versions(webui, browser)
        browser.quit()
        browser = None
        sent = sent_requests(webui.log, args.prompt)
        chat_sent = next((r for r in sent if r["kind"] == "chat"), None)
        messages = (chat_sent or {}).pop("sent_messages", None) or [
            {"role": "user", "content": args.prompt}]
        listed = args.model in page.models_listed
        direct = direct_answer(server, args.model, messages,
                               (chat_sent or {}).get("fields", {})) if listed else ""
        equal, why = compare(page.stored_reply, direct) if listed else (False, "not listed")
        title_request = next((r for r in sent if r["kind"] == "title"), None)
        result = {
            "what": "Open WebUI (PyPI package, unmodified) against `inf2serve serve`'s OpenAI "
                    "router, driven in headless chromium: bench/open_webui_run.py",
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "versions": found_versions,
            "settings": {"openai_connection": OPENAI_SETTINGS, "this_run_only": LOCAL_SETTINGS},
            "model": args.model,
            "model_store": str(args.model_store) if args.model_store else (
                "built: the tiny demo model, model_configs/tiny-llama-cpu.yaml with "
                f"handler.defaults.max_new_tokens {args.reply_tokens} (32 in the file), so "
                "that the reply lasts long enough to watch it stream"),
            "model_listed": listed,
            "models_in_selector": page.models_listed,
            "model_selected": page.picked,
            "dismissed_dialog": page.dismissed or None,
            "prompt": args.prompt,
            "streamed": {
                "distinct_texts": len(page.texts),
                "growing": growing(page.texts),
                "each_longer_than_the_last": monotonic(page.texts),
                "lengths": [len(t) for t in page.texts],
                "first_texts": page.texts[:5],  # the last one is final_text_shown
                "recorded_by": "a MutationObserver on the page: each distinct text the reply "
                               "showed",
                "sampled_every_s": SAMPLE_EVERY_S,
                "distinct_samples": len(page.sampled),
                "sample_lengths": [len(t) for t in page.sampled],
                "first_text_after_s": page.first_text_s,
                "complete_after_s": page.done_s,
            },
            "final_text_shown": page.sampled[-1] if page.sampled else "",
            "reply_received": page.stored_reply,
            "direct_answer": direct,
            "direct_request": "POST {router}/chat/completions: the messages Open WebUI sent, "
                              "temperature 0, not streamed",
            "equal": equal,
            "why_not_equal": why or None,
            "title": {
                "shown": page.title_shown,
                "stored": page.stored_title,
                "changed_from_new_chat": bool(page.title_shown)
                and page.title_shown != "New Chat",
                "generated": page.title_shown not in ("", "New Chat", args.prompt),
                "request_status": title_request.get("status") if title_request else None,
                "server_message": title_request.get("server_message") if title_request
                else None,
            },
            "open_webui_sent": sent,
            "torchserve_access_log": access_log(run_dir, since),
            "ts_log_warnings": ts_log_problems(run_dir, since),
            "phases_s": phases,
            "screenshot": "chat.png",
        }
        result["title"]["note"] = title_note(result["title"])
        if server.inference_token in json.dumps(result):  # it must stay out of the record
            raise RunFailed("the inference token showed up in the result; nothing written")
        if shot.exists():
            shutil.copyfile(shot, args.out / "chat.png")
        return result
    finally:
        if browser is not None:
            browser.quit()
        if webui is not None:
            webui.stop()
        if server is not None or run_dir.exists():
            serve.stop(run_dir)


def title_note(title: dict[str, Any]) -> str:
    """Why the title is what it is, in words: Open WebUI falls back to the first message
    when its title request fails or its answer holds no JSON title (random weights)."""
    if title["generated"]:
        return "Open WebUI's title request answered a JSON title"
    if title["request_status"] == "no failure logged":
        return ("the title request was answered (no failure logged), but the random demo "
                "model wrote no JSON title, so Open WebUI fell back to the first message")
    if title["request_status"] is not None:
        return (f"the title request got a {title['request_status']} "
                f"({title['server_message']}), so Open WebUI fell back to the first message")
    return "no title request seen in Open WebUI's log"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--open-webui", type=Path, default=DEFAULT_OPEN_WEBUI, metavar="EXE",
                   help=f"the open-webui executable (default {DEFAULT_OPEN_WEBUI})")
    p.add_argument("--model-store", type=Path, default=None,
                   help="serve this store instead of building the tiny demo model")
    p.add_argument("--model", default=MODEL, help=f"the model to chat with (default {MODEL})")
    p.add_argument("--reply-tokens", type=int, default=REPLY_TOKENS, metavar="N",
                   help="the built demo's default reply length (default %(default)s, the "
                        "demo's limit; `make demo` packages 32); not with --model-store")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="where result.json and chat.png go (default bench/results/open_webui)")
    p.add_argument("--keep-work", action="store_true",
                   help="keep the work directory (logs, Open WebUI's data) after the run")
    args = p.parse_args(argv)
    if not (args.open_webui.is_file() and os.access(args.open_webui, os.X_OK)):
        print(f"no Open WebUI at {args.open_webui}; install it (its own venv) with:\n  "
              f"{INSTALL_HINT}\nor pass --open-webui PATH", file=sys.stderr)
        return 2
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        print("needs Debian's chromium and chromedriver: make install-browser", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="open-webui-run-"))
    started = time.monotonic()
    keep = args.keep_work
    try:
        result = run(args, work)
    except Exception as exc:  # any failure: say what, and keep the logs
        keep = True
        detail = str(exc) if isinstance(exc, RunFailed) else traceback.format_exc()
        print(f"the run failed: {detail}\nits logs are kept in {work}", file=sys.stderr)
        return 1
    finally:
        if keep:
            say(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    result["wall_time_s"] = round(time.monotonic() - started, 1)
    text = json.dumps(result, indent=2, ensure_ascii=False) + "\n"
    (args.out / "result.json").write_text(text)
    ok = result["model_listed"] and result["streamed"]["growing"]
    say(f"listed: {result['model_listed']}, streamed in {result['streamed']['distinct_texts']} "
        f"parts (growing: {result['streamed']['growing']}), equal to the direct answer: "
        f"{result['equal']}, title: {result['title']['shown']!r}; "
        f"{result['wall_time_s']} s -> {args.out / 'result.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
