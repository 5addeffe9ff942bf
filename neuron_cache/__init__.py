"""Versioned compile cache for Neuron artifacts (NEFFs saved by transformers-neuronx).

Pure Python (no torch, no Neuron SDK) so the CLI and the packager can use it anywhere:

    key.py      what makes two compilations interchangeable -> a stable digest
    store.py    entries on disk: metadata.json, checksums, atomic publish, verify
    lock.py     inter-process lock (fcntl.flock) so concurrent workers compile once
    compile.py  compile-or-load orchestration over any model with load/to_neuron/save
    maintain.py prune and pack plans (plan first, then execute)

Layout of a cache directory (human-readable; one directory per entry):

    <cache>/llama-l32-h4096-tp2-b4-n2048-bf16-1a2b3c4d5e6f/
        metadata.json     key inputs, creation time, sha256 and size of every file
        artifacts/        what model.save() wrote
    <cache>/.locks/       one lock file per key
    <cache>/neuronx-cc/   the compiler's own cache (NEURON_COMPILE_CACHE_URL)
"""

from neuron_cache.key import KeyInputs, sdk_versions
from neuron_cache.store import CacheStore, Entry

__all__ = ["CacheStore", "Entry", "KeyInputs", "sdk_versions"]
