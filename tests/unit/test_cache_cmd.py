"""`inf2serve cache`: ls, verify (exit code), prune (plan, dry run), pack (verified, atomic)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from archive_tools.cli import main
from handlers.config import parse_config
from neuron_cache.key import key_inputs
from neuron_cache.maintain import parse_age, parse_size
from neuron_cache.store import CacheStore

SDK = {"neuronx-cc": "2.15.128.0", "transformers-neuronx": "0.13.322", "torch-neuronx": "2.1.2"}


def _entry(store: CacheStore, batch: int, size: int, age_days: float = 0.0):
    cfg = parse_config({"handler": {"backend": "neuron", "batch_size": batch}}).handler
    key = key_inputs(cfg, {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64}, SDK,
                     model_class="llama.model.LlamaForSampling")

    def write(d: Path) -> None:
        d.mkdir(parents=True)
        (d / "g.neff").write_bytes(b"n" * size)

    entry = store.publish(key, write)
    if age_days:
        meta_path = entry.path / "metadata.json"
        meta = json.loads(meta_path.read_text())
        meta["created_unix"] = time.time() - age_days * 86400
        meta_path.write_text(json.dumps(meta))
    return entry


@pytest.fixture
def cache(tmp_path: Path) -> CacheStore:
    store = CacheStore(tmp_path / "cache")
    _entry(store, 1, 1000, age_days=40)
    _entry(store, 2, 2000, age_days=10)
    _entry(store, 4, 3000)
    return store


def _names(store: CacheStore) -> list[str]:
    return sorted(e.name.split("-")[4] for e in store.entries())  # the "b<batch>" part


def test_ls_lists_entries_with_versions(cache: CacheStore, capsys) -> None:
    assert main(["cache", "ls", "--cache-dir", str(cache.root)]) == 0
    out = capsys.readouterr().out
    assert "3 entries" in out and "2.15.128.0" in out and "0.13.322" in out


def test_verify_exit_code(cache: CacheStore, capsys) -> None:
    assert main(["cache", "verify", "--cache-dir", str(cache.root)]) == 0
    victim = cache.entries()[0]
    (victim.artifacts / "g.neff").write_bytes(b"short")
    assert main(["cache", "verify", "--cache-dir", str(cache.root)]) == 1
    out = capsys.readouterr().out
    assert f"BAD {victim.name}" in out and "2 ok, 1 bad" in out and "prune --corrupt" in out


def test_prune_dry_run_prints_plan_and_keeps_everything(cache: CacheStore, capsys) -> None:
    assert main(["cache", "prune", "--cache-dir", str(cache.root), "--older-than", "30d",
                 "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "plan: remove 1 entries (1.0 KB)" in out and "days ago" in out
    assert _names(cache) == ["b1", "b2", "b4"]


def test_prune_by_age_then_size(cache: CacheStore) -> None:
    assert main(["cache", "prune", "--cache-dir", str(cache.root), "--older-than", "30d"]) == 0
    assert _names(cache) == ["b2", "b4"]
    assert main(["cache", "prune", "--cache-dir", str(cache.root), "--max-size", "4KB"]) == 0
    assert _names(cache) == ["b4"]  # oldest removed first until it fits
    assert not [p for p in cache.root.iterdir() if p.name.startswith(".tmp-")]


def test_prune_corrupt(cache: CacheStore) -> None:
    victim = cache.entries()[1]
    (victim.artifacts / "g.neff").unlink()
    assert main(["cache", "prune", "--cache-dir", str(cache.root), "--corrupt"]) == 0
    assert len(cache.entries()) == 2 and not victim.path.exists()


def test_pack_copies_verified_entries_atomically(cache: CacheStore, tmp_path: Path) -> None:
    archive = tmp_path / "archive"
    assert main(["cache", "pack", "--cache-dir", str(cache.root), str(archive)]) == 0
    packed = CacheStore(archive / "neuron_cache")
    assert sorted(e.name for e in packed.entries()) == sorted(e.name for e in cache.entries())
    assert not [p for p in (archive / "neuron_cache").iterdir() if p.name.startswith(".")]
    assert main(["cache", "verify", "--cache-dir", str(packed.root)]) == 0


def test_pack_refuses_a_corrupt_entry(cache: CacheStore, tmp_path: Path, capsys) -> None:
    (cache.entries()[0].artifacts / "g.neff").write_bytes(b"x")
    assert main(["cache", "pack", "--cache-dir", str(cache.root), str(tmp_path / "a")]) == 2
    assert "will not be packed" in capsys.readouterr().err
    assert not (tmp_path / "a" / "neuron_cache").exists() or \
        not os.listdir(tmp_path / "a" / "neuron_cache")


def test_parsers() -> None:
    assert parse_size("20GB") == 20 * 10**9 and parse_size("1GiB") == 2**30
    assert parse_age("2w") == 14 * 86400 and parse_age("90m") == 5400
    with pytest.raises(Exception, match="e.g. 30d"):
        parse_age("30 days")


def _temp_dir(root: Path, name: str, nbytes: int, age_s: float) -> Path:
    """A `.tmp-*` directory like a killed publish leaves, every mtime `age_s` in the past."""
    path = root / name
    (path / "artifacts").mkdir(parents=True)
    (path / "artifacts" / "g.neff").write_bytes(b"n" * nbytes)
    when = time.time() - age_s
    for p in (path / "artifacts" / "g.neff", path / "artifacts", path):
        os.utime(p, (when, when))
    return path


def test_prune_plans_and_removes_stale_temp_dirs_only(cache: CacheStore, capsys) -> None:
    stale = _temp_dir(cache.root, ".tmp-llama-killed.abc123", 5000, age_s=2 * 3600)
    live = _temp_dir(cache.root, ".tmp-llama-publishing.def456", 7000, age_s=60)
    args = ["cache", "prune", "--cache-dir", str(cache.root), "--older-than", "30d"]
    assert main([*args, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "plan: remove 1 entries and 1 stale temp dirs (6.0 KB)" in out
    assert f"remove {stale} (5.0 KB): temporary directory untouched for 2.0 h" in out
    assert str(live) not in out and stale.exists()
    assert main(args) == 0
    assert not stale.exists() and live.exists()  # an in-progress publish is left alone
    assert _names(cache) == ["b2", "b4"]


def test_remove_waits_for_the_key_lock(cache: CacheStore) -> None:
    import threading

    from neuron_cache.maintain import remove_entry

    entry = cache.entries()[0]
    with cache.lock_for(entry.digest):  # a worker compiling or re-checking this key
        remover = threading.Thread(target=remove_entry, args=(entry.path,))
        remover.start()
        time.sleep(0.5)
        assert entry.path.exists() and remover.is_alive()
    remover.join(timeout=10)
    assert not remover.is_alive() and not entry.path.exists()


def test_prune_corrupt_removes_unreadable_metadata_without_a_lock(cache: CacheStore) -> None:
    victim = cache.entries()[1]
    (victim.path / "metadata.json").write_text("{")
    assert main(["cache", "prune", "--cache-dir", str(cache.root), "--corrupt"]) == 0
    assert not victim.path.exists() and len(cache.entries()) == 2
    assert not (cache.root / ".locks").exists()


def test_the_source_package_is_not_taken_for_a_cache(tmp_path: Path, capsys,
                                                     monkeypatch) -> None:
    """`cache ls` in a clone defaults to ./neuron_cache, which is our library, not a cache."""
    (tmp_path / "neuron_cache").mkdir()
    (tmp_path / "neuron_cache" / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert main(["cache", "ls"]) == 2
    err = capsys.readouterr().err
    assert "a Python package" in err and "--cache-dir model_store/" in err
