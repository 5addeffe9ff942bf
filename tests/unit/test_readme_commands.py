""".ci/readme_commands.py: how README blocks become commands, expected output and directives,
and that every command block of README.md is either run or says why not."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("readme_commands",
                                               REPO / ".ci" / "readme_commands.py")
rc = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("readme_commands", rc)  # dataclasses look their module up there
_spec.loader.exec_module(rc)

SAMPLE = """intro
<!-- ci: output -->
<!-- ci: skip-cmd make x -- slow -->
```bash
inf2serve validate a.yaml \\
    --instance i
# note: first
# warning: long line ...

make x

# a comment after a blank line, not output
```
text between
```python
print(1)
```
<!-- ci: skip no hardware -->

```bash
pip install thing
```
"""


def test_blocks_directives_commands_and_expected_output() -> None:
    blocks = rc.parse_blocks(SAMPLE)
    assert [(b.lang, b.directives) for b in blocks] == [
        ("bash", ["output", "skip-cmd make x -- slow"]), ("python", []),
        ("bash", ["skip no hardware"])]
    cmds = rc.commands(blocks[0])
    assert [c.text for c in cmds] == ["inf2serve validate a.yaml \\\n    --instance i", "make x"]
    assert cmds[0].expected == ["note: first", "warning: long line ..."]
    assert cmds[1].expected == []  # a blank line ends a command's output
    assert cmds[0].line == 5  # 1-based line in the file


def test_output_matching() -> None:
    want = ["note: first", "warning: long line ..."]
    assert rc.output_matches(want, "note: first\n\nwarning: long line, in full\n") is None
    assert "line 1" in rc.output_matches(want, "note: other\nwarning: long line\n")
    assert "missing line 2" in rc.output_matches(want, "note: first\n")
    assert "unexpected line 3" in rc.output_matches(want, "note: first\nwarning: long line\nx\n")


def test_placeholders() -> None:
    assert rc.PLACEHOLDER.findall('curl -H "Bearer TOKEN" http://h:PORT/x $TOKEN MY_PORT') == [
        "TOKEN", "PORT"]


def test_every_readme_block_runs_or_says_why_not() -> None:
    blocks = rc.parse_blocks((REPO / "README.md").read_text("utf-8"))
    assert len(blocks) >= 10
    for b in blocks:
        where = f"README.md:{b.line}"
        if b.has("skip"):
            assert b.args("skip") and b.args("skip")[0], f"{where}: skip without a reason"
            continue
        if b.lang not in rc.SHELL_LANGS | {"python"}:
            continue  # yaml, text, ...: shown, listed by the script as not a command block
        for arg in b.args("skip-cmd"):
            assert " -- " in arg and arg.split(" -- ", 1)[1].strip(), f"{where}: no reason"
        if b.lang != "python":
            assert rc.commands(b), f"{where}: a shell block without commands"
