"""`inf2serve chat` in a real headless browser, against a real TorchServe.

One TorchServe serving the tiny demo model, and two chat pages started as the CLI starts
them: one finding the server (URL and token) through the run directory of
`inf2serve serve`, one given the OpenAI base URL and a wrong token. Debian's chromium,
driven by selenium through Debian's chromedriver (the same build; `make install-browser`
installs both), types into the page as a person would.

What is checked in the page: the reply grows in several steps while it streams (a
MutationObserver records every text the reply shows), and ends as exactly the text the
server gives for the same greedy request without streaming (the raw message, read from
the accessible label Gradio gives each message, as the rendered text is markdown); a
refused token shows as a readable error, on load and on sending, instead of a hang; the
token is nowhere in the page, its config or what the command printed.

Set INF2SERVE_CHAT_SCREENSHOT=docs/chat.png to write the README's screenshot from the run.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from archive_tools.ports import free_port
from tests.e2e.harness import ArchiveSpec, attach_logs_fixture, build_store, running_server

pytestmark = pytest.mark.e2e
MODEL = "tiny-llama"  # the name `make demo` serves it under
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
SYSTEM = "You are a storyteller who keeps it short."
PROMPT = "Tell me a story about a cat."
MAX_TOKENS = 64
START_TIMEOUT_S = 180  # Gradio's import alone takes seconds on a busy 2-core machine
WRONG_TOKEN = "not-the-token"

if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
    pytest.skip("needs Debian's chromium and chromedriver: make install-browser",
                allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (the dev extra)")
if importlib.util.find_spec("gradio") is None:  # the page's process imports it, not this one
    pytest.skip("needs the chat extra (pip install -e '.[chat]')", allow_module_level=True)

from selenium.webdriver.common.by import By  # noqa: E402  (after the skips above)
from selenium.webdriver.common.keys import Keys  # noqa: E402


@dataclass
class ChatProcess:
    """An `inf2serve chat` subprocess and every line it printed."""

    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    url: str = ""

    @property
    def output(self) -> str:
        return "\n".join(self.lines)


def _cli() -> list[str]:
    script = Path(sys.executable).parent / "inf2serve"
    return [str(script)] if script.exists() else [sys.executable, "-m", "archive_tools.cli"]


def _start_chat(args: list[str]) -> tuple[ChatProcess, queue.Queue]:
    proc = subprocess.Popen([*_cli(), "chat", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    chat, lines = ChatProcess(proc), queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            chat.lines.append(line.rstrip("\n"))
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return chat, lines


def _wait_for_page(chat: ChatProcess, lines: queue.Queue) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line is None:
            break
        if line.startswith("chat page: "):
            chat.url = line.split()[2] + "/"
            return
    raise AssertionError(f"`inf2serve chat` printed no page address:\n{chat.output}")


def _stop(chat: ChatProcess) -> None:
    if chat.proc.poll() is None:
        chat.proc.send_signal(signal.SIGTERM)  # the CLI unwinds and closes the page
        try:
            chat.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            chat.proc.kill()
            chat.proc.wait()


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("chat-e2e")
    store = build_store(root, tiny_checkpoint, [ArchiveSpec(MODEL)])
    with running_server(store, root / "run", [MODEL], openai_port=0) as srv:
        yield srv


_attach_logs = attach_logs_fixture()


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return f"{server.inference_url}/predictions/{MODEL}/1.0/v1"


@pytest.fixture(scope="module")
def pages(server, base_url, request: pytest.FixtureRequest) -> Iterator[dict[str, ChatProcess]]:
    """Both chat pages, started together (each spends most of its start importing Gradio),
    and the browser started while they start."""
    started = {
        "good": _start_chat(["--run-dir", str(server.run_dir), "--port", str(free_port()),
                             "--temperature", "0", "--top-p", "1", "--max-tokens",
                             str(MAX_TOKENS), "--system", SYSTEM]),
        "bad": _start_chat(["--url", base_url, "--token", WRONG_TOKEN,
                            "--port", str(free_port())]),
    }
    try:
        request.getfixturevalue("browser")
        for chat, lines in started.values():
            _wait_for_page(chat, lines)
        yield {name: chat for name, (chat, _) in started.items()}
    finally:
        for chat, _ in started.values():
            _stop(chat)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1280,800"):
        options.add_argument(flag)
    # Chromium binds its SingletonSocket under $TMPDIR and exits when that path passes the
    # Unix limit ("Socket path too long"), as a long TMPDIR beside another server makes it
    short_tmp = tempfile.mkdtemp(prefix="chrome-", dir="/tmp" if os.access("/tmp", os.W_OK)
                                 else None)
    service = webdriver.ChromeService(executable_path=str(CHROMEDRIVER),
                                      env={**os.environ, "TMPDIR": short_tmp})
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(short_tmp, ignore_errors=True)


#: records every text the last reply shows, as it changes (no change is missed, however fast)
RECORD_REPLIES = """
window.__replies = [];
const record = () => {
  const bots = document.querySelectorAll('#chat-log [data-testid="bot"]');
  if (!bots.length) return;
  const text = bots[bots.length - 1].textContent, seen = window.__replies;
  if (!seen.length || seen[seen.length - 1] !== text) seen.push(text);
};
new MutationObserver(record).observe(document.getElementById('chat-log'),
                                     {subtree: true, childList: true, characterData: true});
"""


def _wait(what: str, check, timeout_s: float = 60, browser=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.1)
    source = browser.page_source[-3000:] if browser is not None else ""
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{source}")


def _message_box(browser):
    def box():
        boxes = [b for b in browser.find_elements(By.CSS_SELECTOR, "textarea")
                 if b.is_displayed() and b.get_attribute("placeholder") == "Type a message..."]
        return boxes[0] if boxes else None

    return _wait("the message box", box, browser=browser)


def _send(browser, page_url: str, text: str) -> None:
    browser.get(page_url)
    box = _message_box(browser)
    _wait("the chat log", lambda: browser.find_elements(By.ID, "chat-log"), browser=browser)
    browser.execute_script(RECORD_REPLIES)
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def _reply_done(browser) -> bool:
    """A reply is there and the stop button (shown while a reply streams) is gone."""
    return bool(browser.find_elements(By.CSS_SELECTOR, '#chat-log [data-testid="bot"]')
                and not browser.find_elements(By.CSS_SELECTOR, ".stop-button"))


def test_a_reply_streams_into_the_page_and_equals_the_greedy_answer(
        server, base_url, pages, browser, tmp_path: Path) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]
    whole = httpx.post(f"{base_url}/chat/completions", timeout=120,
                       headers={"Authorization": f"Bearer {server.inference_token}"},
                       json={"model": MODEL, "messages": messages, "temperature": 0,
                             "top_p": 1.0, "max_tokens": MAX_TOKENS})
    assert whole.status_code == 200, whole.text
    expected = whole.json()["choices"][0]["message"]["content"]
    assert expected

    page = pages["good"]
    _send(browser, page.url, PROMPT)
    _wait("the reply to end", lambda: _reply_done(browser), browser=browser)
    bot = browser.find_elements(By.CSS_SELECTOR, '#chat-log [data-testid="bot"]')[-1]
    label = bot.get_attribute("aria-label")
    assert label.startswith("bot's message: ")
    # the text as the server sent it, as Gradio keeps every chat message: through
    # inspect.cleandoc (gradio/components/chatbot.py), which drops the leading space a
    # tokenizer's first piece often has
    assert label[len("bot's message: "):] == inspect.cleandoc(expected)

    shown = [t for t in browser.execute_script("return window.__replies") if t]
    assert shown[-1] == browser.execute_script("return arguments[0].textContent", bot)
    assert len(shown) >= 2, f"the reply appeared in one piece: {shown}"
    lengths = [len(t) for t in shown]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1], shown

    shot = tmp_path / "chat.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    if os.environ.get("INF2SERVE_CHAT_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["INF2SERVE_CHAT_SCREENSHOT"])

    # the token stays in the chat process: not in the page, its config, or what it printed
    config = httpx.get(f"{page.url}config", timeout=10)
    assert config.status_code == 200
    for where, text in (("page", browser.page_source), ("config", config.text),
                        ("output", page.output)):
        assert server.inference_token not in text, where


def test_a_refused_token_shows_in_the_page(pages, browser) -> None:
    page = pages["bad"]
    _send(browser, page.url, "Hello")

    def status() -> str:
        found = [e.text for e in browser.find_elements(By.ID, "chat-status")
                 if e.is_displayed()]
        return found[0] if found else ""

    banner = _wait("the banner saying why no model was listed", status, 30, browser)
    assert "refused the token" in banner and "InvalidKeyException" in banner, banner

    def notice() -> str:
        found = [e.text for e in browser.find_elements(By.CSS_SELECTOR,
                                                       '#chat-log [data-testid="bot"]')]
        return found[-1] if found else ""

    error = _wait("the error of the message sent", notice, 30, browser)
    assert error.startswith("Error: the server refused the token (400 InvalidKeyException"), error
    assert "--token" in error  # the fix: this page was given --token
    _wait("the page to be ready for the next message", lambda: _reply_done(browser), 30,
          browser)
    assert "Hello" in browser.find_element(By.ID, "chat-log").text
    assert WRONG_TOKEN not in browser.page_source
    assert "warning: " in page.output and "refused the token" in page.output
