"""Store and compile-or-load: atomic entries, checksums, mismatch policy, one compile per key."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from handlers.config import parse_config
from handlers.errors import CacheError
from neuron_cache.compile import compile_or_load
from neuron_cache.key import key_inputs
from neuron_cache.store import CacheStore, verify

ROOT = Path(__file__).resolve().parents[2]
MODEL = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024}
SDK = {"neuronx-cc": "2.15.128.0", "transformers-neuronx": "0.13.322", "torch-neuronx": "2.1.2"}


def _key(sdk: dict | None = None, **neuron):
    cfg = parse_config({"handler": {"backend": "neuron", "neuron": neuron}}).handler
    return key_inputs(cfg, MODEL, sdk or SDK, model_class="llama.model.LlamaForSampling")


class Model:
    """Records the transformers-neuronx calls it receives; save writes two NEFFs."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def load(self, directory: str) -> None:
        self.calls.append(("load", directory))

    def to_neuron(self) -> None:
        self.calls.append(("to_neuron",))

    def save(self, directory: str) -> None:
        self.calls.append(("save", directory))
        Path(directory).mkdir(parents=True, exist_ok=True)
        Path(directory, "a.neff").write_bytes(b"A" * 1000)
        Path(directory, "b.neff").write_bytes(b"B" * 10)


def test_compile_then_load(tmp_path: Path) -> None:
    store, key = CacheStore(tmp_path), _key()
    first = Model()
    result = compile_or_load(store, key, first)
    assert result.compiled and [c[0] for c in first.calls] == ["to_neuron", "save"]
    meta = json.loads((result.entry.path / "metadata.json").read_text())
    assert meta["key"] == key.digest and meta["inputs"]["sdk"] == SDK
    assert meta["files"]["artifacts/a.neff"]["size"] == 1000
    assert len(meta["files"]["artifacts/a.neff"]["sha256"]) == 64
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]

    second = Model()
    result2 = compile_or_load(store, key, second)
    assert not result2.compiled
    assert second.calls == [("load", str(result.entry.artifacts)), ("to_neuron",)]


@pytest.mark.parametrize("damage,problem", [
    (lambda p: p.write_bytes(b"A" * 999), "999 bytes, expected 1000"),
    (lambda p: p.write_bytes(b"C" * 1000), "sha256 differs"),
    (lambda p: p.unlink(), "missing"),
    (lambda p: p.with_name("extra.neff").write_bytes(b"x"), "not listed"),
])
def test_corrupt_entry_is_caught_by_verify_and_never_loaded(tmp_path: Path, damage,
                                                            problem: str) -> None:
    store, key = CacheStore(tmp_path), _key()
    entry = compile_or_load(store, key, Model()).entry
    damage(entry.artifacts / "a.neff")
    assert any(problem in p for p in verify(entry))
    model = Model()
    with pytest.raises(CacheError, match="is corrupt") as exc:
        compile_or_load(store, key, model)
    assert problem in str(exc.value) and "prune --corrupt" in str(exc.value)
    assert model.calls == []


def test_sdk_mismatch_errors_by_default_naming_what_differs(tmp_path: Path) -> None:
    store = CacheStore(tmp_path)
    compile_or_load(store, _key(), Model())
    newer = _key(sdk={**SDK, "neuronx-cc": "2.16.0"})
    model = Model()
    with pytest.raises(CacheError) as exc:
        compile_or_load(store, newer, model)
    msg = str(exc.value)
    assert "sdk.neuronx-cc: installed/configured '2.16.0', cache entry '2.15.128.0'" in msg
    assert "on_mismatch: recompile" in msg
    assert model.calls == []


def test_flag_mismatch_recompiles_when_asked(tmp_path: Path) -> None:
    store = CacheStore(tmp_path)
    compile_or_load(store, _key(), Model())
    result = compile_or_load(store, _key(compiler_flags=["-O1"]), Model(), "recompile")
    assert result.compiled and len(store.entries()) == 2


def test_other_shapes_compile_without_mismatch(tmp_path: Path) -> None:
    store = CacheStore(tmp_path)
    compile_or_load(store, _key(), Model())
    assert compile_or_load(store, _key(tp_degree=4), Model()).compiled


def test_publish_that_writes_nothing_fails_and_leaves_no_entry(tmp_path: Path) -> None:
    store = CacheStore(tmp_path)
    with pytest.raises(CacheError, match="wrote nothing"):
        store.publish(_key(), lambda d: None)
    assert store.entries() == [] and [p.name for p in tmp_path.iterdir()] == []


WORKER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from handlers.config import parse_config
    from neuron_cache.compile import compile_or_load
    from neuron_cache.key import key_inputs
    from neuron_cache.store import CacheStore

    root, counter = sys.argv[1], sys.argv[2]
    class Model:
        def load(self, d): self.loaded = d
        def to_neuron(self):
            if not hasattr(self, "loaded"):
                with open(counter, "a") as f:
                    f.write(f"{os.getpid()}\\n")
                time.sleep(0.5)  # a slow compile: the others must wait, then load
        def save(self, d):
            Path(d).mkdir(parents=True, exist_ok=True)
            Path(d, "x.neff").write_bytes(b"neff")
    cfg = parse_config({"handler": {"backend": "neuron"}}).handler
    key = key_inputs(cfg, {"model_type": "llama"}, {"neuronx-cc": "1"},
                     model_class="llama.model.LlamaForSampling")
    print("compiled" if compile_or_load(CacheStore(Path(root)), key, Model()).compiled
          else "loaded")
""")


def test_workers_starting_together_compile_once(tmp_path: Path) -> None:
    counter = tmp_path / "compiles.txt"
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path / "cache"),
                               str(counter)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    outs = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert all(p.returncode == 0 for p in procs)
    assert outs == ["compiled", "loaded", "loaded", "loaded"]
    assert len(counter.read_text().splitlines()) == 1
    assert len(CacheStore(tmp_path / "cache").entries()) == 1


def test_publish_fsyncs_files_and_dirs_before_rename_and_root_after(tmp_path: Path,
                                                                    monkeypatch) -> None:
    from neuron_cache import store as store_mod

    store, key = CacheStore(tmp_path), _key()
    final = tmp_path / key.entry_name
    synced: list[tuple[str, bool]] = []  # (name relative to the temp or cache dir, published?)
    real = store_mod._fsync

    def record(path: Path, *, directory: bool = False) -> None:
        path = Path(path)
        rel = "ROOT" if path == tmp_path else "/".join(path.relative_to(tmp_path).parts[1:])
        synced.append((rel or "ENTRY", final.exists()))
        real(path, directory=directory)

    monkeypatch.setattr(store_mod, "_fsync", record)
    store.publish(key, lambda d: Model().save(str(d)))
    before = {name for name, published in synced if not published}
    assert {"artifacts/a.neff", "artifacts/b.neff", "metadata.json", "artifacts",
            "ENTRY"} <= before
    assert synced[-1] == ("ROOT", True)
