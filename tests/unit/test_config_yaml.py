"""model-config.yaml with a key given twice is refused with both lines (handlers/config_yaml)."""

from __future__ import annotations

from pathlib import Path

import pytest

from handlers.config import load_config
from handlers.config_yaml import duplicate_keys, load_yaml
from handlers.errors import ConfigError

TWICE = """\
asyncCommunication: true
handler:
  batch_size: 8
  max_length: 512
  batch_size: 2
"""


def test_a_key_given_twice_names_its_path_and_both_lines() -> None:
    assert duplicate_keys(TWICE) == [("handler.batch_size", 3, 5)]
    with pytest.raises(ConfigError) as info:
        load_yaml(TWICE, "c.yaml")
    assert str(info.value) == ("c.yaml: handler.batch_size is given twice, at line 3 and line 5; "
                               "YAML would silently keep the last one: remove one of them")


@pytest.mark.parametrize("text, found", [
    ("a: 1\nb: 2\n", []),
    ("a: 1\na: 1\n", [("a", 1, 2)]),  # the same value twice is still two keys
    ("h:\n  defaults:\n    top_p: 0.9\n    top_p: 0.5\n", [("h.defaults.top_p", 3, 4)]),
    ("l:\n  - {x: 1, x: 2}\n", [("l[0].x", 2, 2)]),
    # a merge key brings keys in that the mapping may override: not a duplicate
    ("base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  x: 3\n", []),
    ("", []),
])
def test_duplicates_found(text: str, found: list) -> None:
    assert duplicate_keys(text) == found


def test_load_config_refuses_it(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(TWICE)
    with pytest.raises(ConfigError, match=r"handler.batch_size is given twice, at line 3 and "
                                          "line 5"):
        load_config(path)
