"""A Neuron checkpoint against what the SDKs' transformers 4.x read: the JSON rules
(handlers/transformers4_rules.py) and `validate --checkpoint`'s real loads under each 4.x
overlay (archive_tools/transformers4.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from archive_tools import transformers4
from archive_tools.cli import main
from handlers.transformers4_rules import check_files
from tests.overlays import ENV, overlays, transformers_version

CONFIG = Path(__file__).resolve().parents[2] / "model_configs" / "tiny-llama-cpu.yaml"


@pytest.fixture
def ckpt(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    return shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")


def neuron_config(tmp_path: Path) -> Path:
    data = yaml.safe_load(CONFIG.read_text())
    data["handler"]["backend"] = "neuron"
    data["deviceType"] = "neuron"
    path = tmp_path / "neuron.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def merges_as_pairs(ckpt: Path) -> None:
    """tokenizer.json as tokenizers >= 0.20 write it (transformers 5's save)."""
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    tok["model"]["merges"] = [m.split(" ") for m in tok["model"]["merges"]]
    (ckpt / "tokenizer.json").write_text(json.dumps(tok))


def test_prepared_files_pass_the_rules(ckpt: Path) -> None:
    found = check_files(ckpt)
    assert found.problems == [] and found.warnings == []


def test_what_only_old_4x_lines_misread_is_a_warning(ckpt: Path) -> None:
    merges_as_pairs(ckpt)
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "chat_template.jinja").write_text(config.pop("chat_template"))
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    found = check_files(ckpt)
    assert found.problems == []
    assert [w.split(":")[0] for w in found.warnings] == [str(ckpt / "tokenizer.json"),
                                                         str(ckpt / "chat_template.jinja")]
    assert "tokenizers < 0.20 (transformers 4.36 to 4.44) cannot parse" in found.warnings[0]
    assert "transformers < 4.47 read the chat template only from" in found.warnings[1]


def test_rope_at_the_4x_default_is_no_problem(ckpt: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    config.pop("rope_theta", None)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (ckpt / "config.json").write_text(json.dumps(config))
    assert check_files(ckpt).problems == []


def test_overlays_are_found_where_make_puts_them(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "overlays" / "transformers-4.48.3" / "transformers").mkdir(parents=True)
    (tmp_path / "overlays" / "transformers-4.99.0").mkdir()  # no transformers in it
    monkeypatch.delenv(transformers4.OVERLAYS_ENV, raising=False)
    monkeypatch.setattr(transformers4.sys, "prefix", str(tmp_path))
    assert transformers4.overlays() == [tmp_path / "overlays" / "transformers-4.48.3"]
    monkeypatch.setenv(transformers4.OVERLAYS_ENV, "")
    assert transformers4.overlays() == []  # set and empty: none


def test_without_overlays_validate_says_it_checked_by_rule(ckpt: Path, tmp_path: Path,
                                                          monkeypatch, capsys) -> None:
    monkeypatch.setenv(transformers4.OVERLAYS_ENV, "")
    assert main(["validate", str(neuron_config(tmp_path)), "--checkpoint", str(ckpt)]) == 0
    assert "checked by rule only; `make overlays` builds them" in capsys.readouterr().out


needs_overlays = pytest.mark.skipif(not overlays(), reason=f"no ${ENV} (make test sets it)")


@needs_overlays
def test_validate_loads_a_neuron_checkpoint_under_every_4x(ckpt: Path, tmp_path: Path, capsys,
                                                           validate_under_overlays) -> None:
    """What the rules only warn about, a real 4.x load refuses: transformers 4.36's
    tokenizers 0.15 cannot parse merges stored as pairs."""
    config = str(neuron_config(tmp_path))
    assert main(["validate", config, "--checkpoint", str(ckpt)]) == 0
    versions = ", ".join(transformers_version(o) for o in overlays())
    assert (f"note: tokenizer and config.json load under transformers {versions} (the Neuron "
            "SDKs' 4.x)") in capsys.readouterr().out
    merges_as_pairs(ckpt)
    code = main(["validate", config, "--checkpoint", str(ckpt)])
    err = capsys.readouterr().err
    if not any(o.name == "transformers-4.36.2" for o in overlays()):
        pytest.skip("no transformers 4.36 overlay")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --checkpoint {ckpt}: does not load under "
                          "transformers-4.36.2 (a Neuron SDK's transformers), as a neuron worker "
                          "loads it: Exception: data did not match any variant"), err
    assert "run `inf2serve prepare SRC OUT`" in err


@needs_overlays
def test_a_family_newer_than_an_overlay_loads_under_those_that_know_it(
        family_checkpoint, validate_under_overlays) -> None:
    """Qwen2 arrived in transformers 4.37: 4.36 (transformers-neuronx's floor) is passed over
    with a note, the later lines load it; a model_type none of them knows is refused."""
    ckpt = family_checkpoint("qwen2")
    versions = [transformers_version(o) for o in overlays()]
    knowing = [v for v in versions if tuple(map(int, v.split(".")[:2])) >= (4, 37)]
    if not knowing or len(knowing) == len(versions):
        pytest.skip("needs overlays on both sides of transformers 4.37")
    notes = transformers4.check_loads_under_4x(ckpt)
    assert notes[0] == (f"tokenizer and config.json load under transformers "
                        f"{', '.join(knowing)} (the Neuron SDKs' 4.x)")
    assert "predate" in notes[1] and "model_type 'qwen2'" in notes[1], notes


@needs_overlays
def test_a_model_type_no_overlay_knows_is_refused(ckpt: Path, validate_under_overlays) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "model_type": "llama9"}))
    with pytest.raises(Exception, match="model_type 'llama9' is unknown to transformers"):
        transformers4.check_loads_under_4x(ckpt)
