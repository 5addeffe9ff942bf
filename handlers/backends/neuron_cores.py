"""NeuronCores per TorchServe worker: each claims a disjoint, contiguous block of tp_degree cores.

TorchServe starts workers as separate processes and tells them nothing about each
other, so blocks are claimed through lock files (fcntl.flock, one per block) in
handler.neuron.core_lock_dir. The worker holds its lock for its whole life; the
kernel frees it when the process exits, even on a crash, so a restarted worker can
take the block again.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from handlers.errors import ConfigError
from neuron_cache.lock import holder, try_lock, unlock

if TYPE_CHECKING:
    from handlers.config import NeuronSettings

log = logging.getLogger(__name__)
CORES_PER_DEVICE = 2  # Inferentia2: 2 NeuronCores per chip (/dev/neuronN)


def parse_cores(text: str) -> list[int]:
    """NEURON_RT_VISIBLE_CORES syntax: "0-3", "4", "0,2,4-5" -> sorted core ids."""
    cores: set[int] = set()
    for part in text.replace(" ", "").split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m or (m.group(2) and int(m.group(2)) < int(m.group(1))):
            raise ConfigError(f"NEURON_RT_VISIBLE_CORES: {text!r} is not a core list; expected "
                              "ids and ranges like '0-3' or '0,2,4-5'")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        cores.update(range(lo, hi + 1))
    return sorted(cores)


def available_cores(settings: NeuronSettings, environ: Mapping[str, str] | None = None,
                    dev_dir: Path = Path("/dev")) -> list[int]:
    """Cores on offer: cores_per_instance, else NEURON_RT_VISIBLE_CORES, else /dev/neuron* x 2."""
    environ = os.environ if environ is None else environ
    if settings.cores_per_instance:
        return list(range(settings.cores_per_instance))
    if environ.get("NEURON_RT_VISIBLE_CORES"):
        return parse_cores(environ["NEURON_RT_VISIBLE_CORES"])
    devices = [p for p in Path(dev_dir).glob("neuron*") if re.fullmatch(r"neuron\d+", p.name)]
    if not devices:
        raise ConfigError(
            f"no NeuronCores found: handler.neuron.cores_per_instance is 0, "
            f"NEURON_RT_VISIBLE_CORES is unset and {dev_dir} has no neuron* devices. Run on an "
            "Inf2 instance with the Neuron driver, or set cores_per_instance")
    return list(range(len(devices) * CORES_PER_DEVICE))


def core_blocks(cores: Sequence[int], tp_degree: int) -> list[tuple[int, ...]]:
    """Disjoint blocks of tp_degree consecutive ids; a trailing remainder is left unused."""
    cores = sorted(cores)
    blocks = []
    i = 0
    while i + tp_degree <= len(cores):
        block = tuple(cores[i:i + tp_degree])
        if block[-1] - block[0] == tp_degree - 1:
            blocks.append(block)
            i += tp_degree
        else:  # a gap in the visible list: restart the block after it
            i += 1
    return blocks


@dataclass
class CoreClaim:
    """The block this worker holds until `release()` or process exit."""

    cores: tuple[int, ...]
    lock_path: Path
    _fd: int | None

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            unlock(fd)


def lock_path(lock_dir: Path, block: Sequence[int]) -> Path:
    return Path(lock_dir) / f"cores-{block[0]}-{block[-1]}.lock"


def claim_cores(settings: NeuronSettings, cores: Sequence[int]) -> CoreClaim:
    """Take the first free block of tp_degree cores; ConfigError with the numbers if none is."""
    tp = settings.tp_degree
    blocks = core_blocks(cores, tp)
    lock_dir = Path(settings.core_lock_dir)
    if not blocks:
        raise ConfigError(
            f"handler.neuron.tp_degree: {tp} needs {tp} contiguous NeuronCores, but this host "
            f"offers {len(cores)} ({','.join(map(str, cores)) or 'none'}); lower tp_degree or use "
            "a larger instance")
    for block in blocks:
        path = lock_path(lock_dir, block)
        fd = try_lock(path)
        if fd is not None:
            log.info("claimed NeuronCores %d-%d (tp_degree %d) via %s", block[0], block[-1],
                     tp, path)
            return CoreClaim(block, path, fd)
    holders = ", ".join(f"{b[0]}-{b[-1]} by pid {holder(lock_path(lock_dir, b))}" for b in blocks)
    raise ConfigError(
        f"no free NeuronCores for this worker: {len(cores)} cores make {len(blocks)} block(s) of "
        f"tp_degree {tp}, all taken ({holders or 'none'}). Run at most {len(blocks)} worker(s) "
        f"(minWorkers/maxWorkers), lower handler.neuron.tp_degree, or use a larger instance; "
        f"locks live in {lock_dir}")


def backend_claim(settings: NeuronSettings, held: Sequence[int] | None) -> CoreClaim:
    """The cores a Neuron backend runs on: the block the TorchServe worker already claimed
    and holds for its whole life (`held`, from handlers/engine/client.py; releasing this
    claim leaves the worker's lock alone), or a block of its own claimed now (inline)."""
    if held is None:
        return claim_cores(settings, available_cores(settings))
    return CoreClaim(tuple(held), lock_path(Path(settings.core_lock_dir), held), None)
