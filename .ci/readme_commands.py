#!/usr/bin/env python3
"""Run every command block of README.md, then of the guides in docs/, in order, in a fresh
copy of the repository.

The README and its guides are the newcomer's script, so CI runs them as one: README.md first,
then each docs/*.md in the order GUIDES gives (a guide may use what an earlier one left: a
packaged archive, a prepared checkpoint, a running server); a guide GUIDES does not list stops
the run before it starts. Each document starts in the repository's root; within it each
```bash block runs command by command (continuation lines joined, `cd` followed), each
```python block as a program, in a copy of the tracked and new files (what a fresh clone
holds; `.venv` is shared, never reinstalled: `make` runs with VENV=<this venv> and its install
stamp taken as up to date). A command passes when it exits 0; curl fails on an HTTP error
status (a `.curlrc` with --fail-with-body). Placeholders are filled from the running server of
`.serve/` (one is started with `inf2serve serve` when a block needs one and none runs): `PORT`
(the inference port), `TOKEN` and `$TOKEN` (the inference key).

HTML comments right before a block's fence direct the run, one per comment:
  <!-- ci: output -->           comment lines right after a command are its whole output
                                 (a line ending in "..." matches by prefix); an expected
                                 line starting with "error:" means a non-zero exit
  <!-- ci: neuron-fake -->      run with the fake Neuron SDK of tests/fakes (no Inferentia here)
  <!-- ci: sub OLD => NEW -->   replace text before running (a path that exists only elsewhere)
  <!-- ci: skip REASON -->      do not run the block; the reason is printed
  <!-- ci: skip-cmd PREFIX -- REASON -->  do not run commands starting with PREFIX
Blocks of any other language are listed as not run. Nothing is skipped without a line saying
so. Exit status 1 if any command failed, 2 if docs/ and GUIDES disagree.

usage: python .ci/readme_commands.py [--readme README.md] [--docs docs] [--keep] [--list] [-v]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHELL_LANGS = {"bash", "sh", "shell"}
DIRECTIVE = re.compile(r"^<!--\s*ci:\s*(?P<body>.*?)\s*-->$")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
PLACEHOLDER = re.compile(r"(?<![$\w])(PORT|TOKEN)\b")
COMMAND_TIMEOUT_S = 600
SERVER_MODEL = "tiny-llama"  # the quick start's model, served when a block needs a server
# The guides of docs/, in the order their blocks run after README.md's. Their commands build on
# each other as the README's sections did when they were one file: packaging prepares the
# checkpoint and archives that Inferentia2's commands compile, OpenAI's and benchmarking's
# blocks use the quick start's model. A new guide goes where what it needs exists.
GUIDES = (
    "request-api.md",
    "configuration.md",
    "packaging-and-deploying.md",
    "inferentia2.md",
    "openai.md",
    "structured_outputs.md",
    "monitoring.md",
    "benchmarking.md",
    "development.md",
    "design.md",
)


class GuideOrderError(ValueError):
    """docs/ holds a guide GUIDES does not list, or GUIDES lists one docs/ lacks."""


@dataclass
class Command:
    line: int
    text: str
    expected: list[str] = field(default_factory=list)


@dataclass
class Block:
    line: int
    lang: str
    body: list[str]
    directives: list[str]
    doc: str = "README.md"  # the document, as the run names it

    def has(self, name: str) -> bool:
        return any(d == name or d.startswith(name + " ") for d in self.directives)

    def args(self, name: str) -> list[str]:
        return [d[len(name):].strip() for d in self.directives if d.startswith(name + " ")]


def documents(readme: Path, docs: Path, order: tuple[str, ...] = GUIDES) -> list[Path]:
    """README.md, then every guide of `docs` in `order`; a guide missing from `order`, or one
    `order` names that `docs` lacks, is a GuideOrderError naming it."""
    found = sorted(p.name for p in docs.glob("*.md")) if docs.is_dir() else []
    problems = [f"{docs.name}/{name} is not in GUIDES of .ci/readme_commands.py: add it where "
                f"its commands can run (after the guides whose state they use)"
                for name in found if name not in order]
    problems += [f"GUIDES of .ci/readme_commands.py lists {docs.name}/{name}, which does not "
                 f"exist" for name in order if name not in found]
    if problems:
        raise GuideOrderError("; ".join(problems))
    return [readme, *(docs / name for name in order)]


def doc_name(path: Path) -> str:
    """A document's name in the run's output: its path in the repository, where it is in it."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def parse_blocks(text: str, doc: str = "README.md") -> list[Block]:
    """Every fenced block, with the `ci:` directives in the comments right above its fence."""
    blocks, pending, lines = [], [], text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if m := DIRECTIVE.match(line):
            pending.append(m["body"])
        elif m := FENCE.match(line):
            start, body = i + 1, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            blocks.append(Block(start, m["lang"] or "text", body, pending, doc))
            pending = []
        elif line:
            pending = []
        i += 1
    return blocks


def commands(block: Block) -> list[Command]:
    """A shell block's commands (continuations joined); with `output`, the comment lines
    right after a command are its expected output."""
    out: list[Command] = []
    i, body, attach = 0, block.body, False
    while i < len(body):
        stripped = body[i].strip()
        if not stripped:
            attach = False  # a blank line ends a command's output
        elif stripped.startswith("#"):
            if attach and block.has("output"):
                out[-1].expected.append(stripped[1:].strip())
        else:
            start, parts = i, [body[i].rstrip()]
            while parts[-1].endswith("\\") and i + 1 < len(body):
                i += 1
                parts.append(body[i].rstrip())
            out.append(Command(block.line + start + 1, "\n".join(parts)))
            attach = True
        i += 1
    return out


def output_matches(expected: list[str], output: str) -> str | None:
    """None when `output` is exactly `expected` (a line ending in "..." matches by prefix),
    else what differs."""
    got = [ln.rstrip() for ln in output.splitlines() if ln.strip()]
    for n, want in enumerate(expected):
        if n >= len(got):
            return f"missing line {n + 1}: {want!r}"
        ok = (got[n].startswith(want[:-3].rstrip()) if want.endswith("...")
              else got[n] == want)
        if not ok:
            return f"line {n + 1}: expected {want!r}, got {got[n]!r}"
    if len(got) > len(expected):
        return f"unexpected line {len(expected) + 1}: {got[len(expected)]!r}"
    return None


def fresh_copy(dest: Path) -> None:
    """The tracked and new (not ignored) files, as a clone of this working tree would hold."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


class Runner:
    def __init__(self, root: Path, scratch: Path, venv: Path) -> None:
        self.root, self.scratch, self.venv, self.cwd = root, scratch, venv, root
        self.failures: list[str] = []
        self.skipped: list[str] = []
        self.ran = 0
        self.verbose = False
        tools = scratch / "tools"  # outside the copy, so `make lint` sees only the README's files
        tools.mkdir()
        make = tools / "make"  # the shared venv, taken as installed: never pip install here
        make.write_text(f"#!/bin/sh\nexec {shutil.which('make')} VENV={venv} "
                        f"-o {venv}/.installed \"$@\"\n")
        make.chmod(0o755)
        (tools / ".curlrc").write_text("fail-with-body\n")
        (scratch / "tmp").mkdir()
        self.env = dict(os.environ)
        self.env.update(
            PATH=f"{tools}:{venv / 'bin'}:{os.environ['PATH']}", CURL_HOME=str(tools),
            PYTHONPATH=str(root),  # this copy's code, ahead of the venv's editable install
            TMPDIR=str(scratch / "tmp"),  # a stock TorchServe's pid file: ours alone
            COLUMNS="100")
        self.env.pop("VIRTUAL_ENV", None)

    def start_document(self) -> None:
        """A document's commands start in the repository's root, as its reader's do."""
        self.cwd = self.root

    def _env(self, block: Block) -> dict[str, str]:
        env = dict(self.env)
        if block.has("neuron-fake"):
            env.update(PYTHONPATH=f"{self.root / 'tests' / 'fakes'}:{self.root}",
                       NEURON_RT_VISIBLE_CORES="0-1",
                       INF2SERVE_FAKE_NEURON_DEVICE_DIR=str(self.scratch / "device"))
        return env

    def _sh(self, text: str, env: dict[str, str], timeout: float = COMMAND_TIMEOUT_S):
        """Run one command; output goes through a file, not a pipe, because a daemon it
        starts (`torchserve --start`) keeps its inherited stdout open."""
        log = self.scratch / "output.txt"
        with open(log, "w") as out:
            r = subprocess.run(["bash", "-o", "pipefail", "-c", text], cwd=self.cwd, env=env,
                               stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                               timeout=timeout)
        return subprocess.CompletedProcess(r.args, r.returncode, log.read_text(errors="replace"))

    def server(self) -> tuple[str, str]:
        """(port, token) of the server of .serve/, started if none runs."""
        run = self.root / ".serve"
        info = run / "server.json"
        alive = info.exists() and _alive(int(json.loads(info.read_text())["pid"]))
        if not alive:
            cmd = f"inf2serve serve --model-store model_store --models {SERVER_MODEL}"
            print(f"    (no server runs for this block's PORT/TOKEN; starting one: {cmd})")
            cwd, self.cwd = self.cwd, self.root
            r, self.cwd = self._sh(cmd, self.env), cwd
            if r.returncode:
                raise RuntimeError(f"could not start a server:\n{r.stdout}")
        url = json.loads(info.read_text())["inference_url"]
        token = json.loads((run / "key_file.json").read_text())["inference"]["key"]
        return url.rsplit(":", 1)[1], token

    def fill(self, text: str, lang: str, env: dict[str, str]) -> str:
        if not PLACEHOLDER.search(text) and "$TOKEN" not in text:
            return text
        port, token = self.server()
        env["TOKEN"] = token
        token_text = json.dumps(token) if lang == "python" else token
        return PLACEHOLDER.sub(lambda m: port if m[1] == "PORT" else token_text, text)

    def run_block(self, block: Block) -> None:
        where = f"{block.doc}:{block.line}"
        if block.has("skip"):
            reason = " ".join(block.args("skip")) or "(no reason given)"
            self.skipped.append(f"{where} ({block.lang} block): {reason}")
            print(f"== {where} ({block.lang}): SKIPPED, {reason}")
            return
        if block.lang not in SHELL_LANGS | {"python"}:
            self.skipped.append(f"{where} ({block.lang} block): not a command block")
            print(f"== {where} ({block.lang}): not a command block, not run")
            return
        print(f"== {where} ({block.lang})" + "".join(f" [{d}]" for d in block.directives))
        env = self._env(block)
        if block.lang == "python":
            code = self._sub(block, "\n".join(block.body))
            script = self.scratch / f"{Path(block.doc).stem}_{block.line}.py"
            script.write_text(self.fill(code, "python", env))
            start = time.monotonic()
            result = self._sh(f"python {script}", env)
            self._check(where, "python block", result, [], time.monotonic() - start)
            return
        skips = [a.split(" -- ", 1) for a in block.args("skip-cmd")]
        for cmd in commands(block):
            here = f"{block.doc}:{cmd.line}"
            first = cmd.text.splitlines()[0]
            reason = next((why.strip() for prefix, why in skips
                           if re.match(re.escape(prefix.strip()) + r"(\s|$)", cmd.text)), None)
            if reason is not None:
                self.skipped.append(f"{here}: {first}: {reason}")
                print(f"  $ {first}\n    SKIPPED: {reason}")
                continue
            text = self.fill(self._sub(block, cmd.text), "bash", env)
            print(f"  $ {first}{' ...' if chr(10) in cmd.text else ''}")
            if re.fullmatch(r"cd\s+\S+", text.strip()):
                self.cwd = (self.cwd / text.split()[1]).resolve()
                self.ran += 1
                continue
            start = time.monotonic()
            try:
                result = self._sh(text, env)
            except subprocess.TimeoutExpired:
                self.failures.append(f"{here}: timed out after {COMMAND_TIMEOUT_S}s: {first}")
                print("    FAILED: timed out")
                continue
            self._check(here, first, result, cmd.expected, time.monotonic() - start)

    def _sub(self, block: Block, text: str) -> str:
        for arg in block.args("sub"):
            old, new = (s.strip() for s in arg.split("=>", 1))
            if old in text:
                print(f"    (ci: {old!r} replaced by {new!r})")
                text = text.replace(old, new)
        return text

    def _check(self, where: str, what: str, result, expected: list[str],
               took: float = 0.0) -> None:
        self.ran += 1
        want_error = any(line.startswith("error:") for line in expected)
        problem = None
        if want_error != (result.returncode != 0):
            problem = (f"exit status {result.returncode}, expected "
                       f"{'non-zero' if want_error else '0'}")
        elif expected:
            problem = output_matches(expected, result.stdout)
        if problem:
            self.failures.append(f"{where}: {what}: {problem}")
            tail = "\n".join(result.stdout.splitlines()[-40:])
            print(f"    FAILED: {problem}\n" + "\n".join("    | " + ln for ln in tail.splitlines()))
        else:
            print(f"    ok ({took:.1f}s)")
            if self.verbose:
                print("\n".join("    | " + ln for ln in result.stdout.splitlines()))

    def cleanup(self) -> None:
        self.cwd = self.root
        for cmd in ("inf2serve stop", "torchserve --stop"):
            self._sh(cmd + " >/dev/null 2>&1 || true", self.env, timeout=120)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--readme", type=Path, default=REPO / "README.md")
    ap.add_argument("--docs", type=Path, default=REPO / "docs",
                    help="the guides' folder; each *.md in it must be in GUIDES")
    ap.add_argument("--venv", type=Path, default=Path(sys.prefix),
                    help="the built virtualenv (default: this interpreter's)")
    ap.add_argument("--keep", action="store_true", help="keep the copy (its path is printed)")
    ap.add_argument("--list", action="store_true", help="list blocks and commands, run nothing")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every command's output")
    args = ap.parse_args(argv)
    try:
        docs = documents(args.readme, args.docs)
    except GuideOrderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    parsed = [parse_blocks(d.read_text("utf-8"), doc_name(d)) for d in docs]
    if args.list:
        for b in (b for blocks in parsed for b in blocks):
            print(f"{b.doc}:{b.line} {b.lang} {b.directives}")
            for c in commands(b) if b.lang in SHELL_LANGS else []:
                print(f"  {c.line}: {c.text.splitlines()[0]}" + "".join(
                    f"\n      # {e}" for e in c.expected))
        return 0
    base = Path(tempfile.mkdtemp(prefix="inf2serve-readme-"))
    root, scratch = base / "repo", base / "ci"
    root.mkdir()
    scratch.mkdir()
    start = time.monotonic()
    fresh_copy(root)
    runner = Runner(root, scratch, args.venv.absolute())
    runner.verbose = args.verbose
    print(f"running the commands of {', '.join(doc_name(d) for d in docs)} in {root} "
          f"(venv {args.venv})")
    try:
        for blocks in parsed:
            runner.start_document()
            for block in blocks:
                runner.run_block(block)
    finally:
        runner.cleanup()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print(f"\nREADME and guide commands ({len(docs)} documents): {runner.ran} run, "
          f"{len(runner.failures)} failed, {len(runner.skipped)} not run, "
          f"in {time.monotonic() - start:.0f}s")
    for s in runner.skipped:
        print(f"  not run: {s}")
    for f in runner.failures:
        print(f"  FAILED: {f}")
    return 1 if runner.failures else 0


if __name__ == "__main__":
    sys.exit(main())
