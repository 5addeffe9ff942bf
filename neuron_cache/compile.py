"""Compile once, load everywhere else: the start-up path of a Neuron worker.

Works on any model object with the transformers-neuronx top-level API:
`load(dir)` (before `to_neuron()`), `to_neuron()` (compiles, or loads the NEFFs
given to `load`) and `save(dir)` (after `to_neuron()`).

    entry for the key?  yes -> verify checksums -> load(entry) -> to_neuron()
                        no  -> same model built by another SDK/flags? on_mismatch
                               lock the key; re-check (a peer may have finished);
                               to_neuron() -> save -> publish atomically
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

from neuron_cache.errors import CacheError
from neuron_cache.key import KeyInputs, is_build_mismatch
from neuron_cache.store import CacheStore, Entry

log = logging.getLogger(__name__)


class CompilableModel(Protocol):
    def load(self, directory: str) -> None: ...
    def to_neuron(self) -> None: ...
    def save(self, directory: str) -> None: ...


@dataclass(frozen=True)
class StartResult:
    entry: Entry
    compiled: bool  # False: loaded from the cache
    seconds: float


def _fmt(value: object) -> str:
    return " ".join(value) if isinstance(value, list) else str(value)


def mismatch_message(store: CacheStore, inputs: KeyInputs, entry: Entry,
                     diff: dict[str, tuple[object, object]]) -> str:
    what = "; ".join(f"{k}: installed/configured {_fmt(ours)!r}, cache entry {_fmt(theirs)!r}"
                     for k, (ours, theirs) in diff.items())
    return (f"compile cache {store.root} holds {entry.name} for this model and shapes, built "
            f"with another SDK or compiler flags ({what}). Install the SDK versions it was built "
            "with, or set handler.neuron.on_mismatch: recompile to compile a new entry "
            "(`inf2serve cache prune` removes the old one)")


def check_mismatch(store: CacheStore, inputs: KeyInputs, on_mismatch: str) -> None:
    """Raise (on_mismatch=error) when only the SDK or the flags differ from an existing entry."""
    found = store.closest(inputs)
    if found is None:
        return
    entry, diff = found
    if not is_build_mismatch(inputs, entry.inputs):
        log.info("compile cache %s: no entry for this key; closest is %s (differs in %s)",
                 store.root, entry.name, ", ".join(diff))
        return
    message = mismatch_message(store, inputs, entry, diff)
    if on_mismatch == "error":
        raise CacheError(message)
    log.warning("%s; on_mismatch=recompile: compiling a new entry", message)


def _load(store: CacheStore, entry: Entry, model: CompilableModel) -> StartResult:
    store.checked(entry)
    start = time.monotonic()
    log.info("loading compiled model from %s", entry.path)
    model.load(str(entry.artifacts))
    model.to_neuron()
    seconds = time.monotonic() - start
    log.info("loaded %s in %.1fs (no compilation)", entry.name, seconds)
    return StartResult(entry, compiled=False, seconds=seconds)


def compile_or_load(store: CacheStore, inputs: KeyInputs, model: CompilableModel,
                    on_mismatch: str = "error") -> StartResult:
    """Bring `model` onto Neuron from the cache, compiling and publishing it at most once."""
    entry = store.find(inputs)
    if entry is not None:
        return _load(store, entry, model)
    check_mismatch(store, inputs, on_mismatch)
    with store.lock(inputs):
        entry = store.find(inputs)  # a peer may have published while we waited
        if entry is not None:
            return _load(store, entry, model)
        start = time.monotonic()
        log.info("compiling %s (tp_degree %d, batch %d, n_positions %d, %s); this takes minutes",
                 inputs.entry_name, inputs.tp_degree, inputs.batch_size, inputs.n_positions,
                 inputs.amp)
        model.to_neuron()
        compiled_s = time.monotonic() - start
        log.info("compiled %s in %.1fs", inputs.entry_name, compiled_s)
        entry = store.publish(inputs, lambda d: model.save(str(d)))
        log.info("published %s (%.1f MB) in %.1fs total", entry.path, entry.size / 1e6,
                 time.monotonic() - start)
        return StartResult(entry, compiled=True, seconds=compiled_s)
