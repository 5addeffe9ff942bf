""".ci/readme_commands.py: how README blocks become commands, expected output and directives,
that README.md runs first and then every guide of docs/ in GUIDES' order (a guide left out of
GUIDES is an error), that every command block of them is either run or says why not, and that
their links between one another resolve."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

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


def all_documents() -> list[Path]:
    return rc.documents(REPO / "README.md", REPO / "docs")


def test_readme_first_then_every_guide_in_order() -> None:
    docs = all_documents()
    assert docs[0] == REPO / "README.md"
    assert [d.name for d in docs[1:]] == list(rc.GUIDES)
    assert sorted(p.name for p in (REPO / "docs").glob("*.md")) == sorted(rc.GUIDES)
    assert [rc.doc_name(d) for d in docs[:2]] == ["README.md", f"docs/{rc.GUIDES[0]}"]


def test_a_guide_missing_from_the_order_is_an_error(tmp_path: Path, capsys) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("a.md", "b.md", "c.md"):
        (docs / name).write_text(f"# {name}\n")
    readme = tmp_path / "README.md"
    readme.write_text("# r\n")
    assert rc.documents(readme, docs, ("c.md", "a.md", "b.md")) == [
        readme, docs / "c.md", docs / "a.md", docs / "b.md"]
    with pytest.raises(rc.GuideOrderError, match=r"docs/b\.md is not in GUIDES") as e:
        rc.documents(readme, docs, ("a.md", "c.md"))
    assert str(e.value).count("docs/") == 1  # only the guide left out
    with pytest.raises(rc.GuideOrderError, match=r"lists docs/gone\.md, which does not exist"):
        rc.documents(readme, docs, ("a.md", "b.md", "c.md", "gone.md"))
    # the script itself stops before it copies or runs anything, naming the guide
    assert rc.main(["--list", "--readme", str(readme), "--docs", str(docs)]) == 2
    assert "error: docs/a.md is not in GUIDES" in capsys.readouterr().err


def test_blocks_carry_their_document_and_each_document_starts_at_the_root(
        tmp_path: Path) -> None:
    root, scratch = tmp_path / "repo", tmp_path / "ci"
    (root / "sub").mkdir(parents=True)
    scratch.mkdir()
    runner = rc.Runner(root, scratch, Path(sys.prefix))
    first = rc.parse_blocks("```bash\ncd sub\n```\n<!-- ci: skip no -->\n```bash\nx\n```\n",
                            "docs/one.md")
    assert [b.doc for b in first] == ["docs/one.md", "docs/one.md"]
    for b in first:
        runner.run_block(b)
    assert runner.cwd == root / "sub" and runner.ran == 1
    assert runner.skipped == ["docs/one.md:5 (bash block): no"]
    runner.start_document()
    assert runner.cwd == root
    (block,) = rc.parse_blocks(f"<!-- ci: output -->\n```bash\npwd\n# {root.resolve()}\n```\n",
                               "docs/two.md")
    runner.run_block(block)
    assert runner.failures == [] and runner.ran == 2


def test_every_readme_block_runs_or_says_why_not() -> None:
    blocks = [b for d in all_documents()
              for b in rc.parse_blocks(d.read_text("utf-8"), rc.doc_name(d))]
    assert len(blocks) >= 10
    for b in blocks:
        where = f"{b.doc}:{b.line}"
        if b.has("skip"):
            assert b.args("skip") and b.args("skip")[0], f"{where}: skip without a reason"
            continue
        if b.lang not in rc.SHELL_LANGS | {"python"}:
            continue  # yaml, text, ...: shown, listed by the script as not a command block
        for arg in b.args("skip-cmd"):
            assert " -- " in arg and arg.split(" -- ", 1)[1].strip(), f"{where}: no reason"
        if b.lang != "python":
            assert rc.commands(b), f"{where}: a shell block without commands"


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces to -."""
    out = set()
    for line in re.sub(r"```.*?```", "", text, flags=re.S).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            out.add(re.sub(r"[^\w\- ]", "", m[1].strip().lower()).replace(" ", "-"))
    return out


def test_links_between_readme_and_guides_resolve() -> None:
    """Every relative link of README.md and docs/*.md names a file that exists, and its
    #anchor a heading there (the README's sections moved into docs/; nothing points to an
    old anchor)."""
    bad, checked = [], 0
    for doc in all_documents():
        text = doc.read_text("utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            checked += 1
            if not dest.exists():
                bad.append(f"{rc.doc_name(doc)}: {target}: no such file")
            elif anchor and anchor not in _anchors(dest.read_text("utf-8")):
                bad.append(f"{rc.doc_name(doc)}: {target}: no such heading")
    assert not bad, bad
    assert checked >= 20
