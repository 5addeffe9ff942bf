"""Core allocator: disjoint contiguous blocks, clear failure, freed when the holder exits."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from handlers.backends.neuron_cores import available_cores, claim_cores, core_blocks, parse_cores
from handlers.config import NeuronSettings
from handlers.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _settings(tmp_path: Path, tp: int = 2, cores: int = 0) -> NeuronSettings:
    return NeuronSettings(tp_degree=tp, cores_per_instance=cores,
                          core_lock_dir=str(tmp_path / "locks"))


def test_parse_cores() -> None:
    assert parse_cores("0-3") == [0, 1, 2, 3]
    assert parse_cores("4, 0,2-3") == [0, 2, 3, 4]
    with pytest.raises(ConfigError, match="not a core list"):
        parse_cores("3-1")


def test_available_cores_sources(tmp_path: Path) -> None:
    assert available_cores(_settings(tmp_path, cores=4), {}) == [0, 1, 2, 3]
    assert available_cores(_settings(tmp_path), {"NEURON_RT_VISIBLE_CORES": "4-7"}) == [4, 5, 6, 7]
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("neuron0", "neuron1", "neuron_monitor"):
        (dev / name).touch()
    assert available_cores(_settings(tmp_path), {}, dev) == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="no NeuronCores found"):
        available_cores(_settings(tmp_path), {}, tmp_path / "empty")


def test_blocks_are_contiguous_and_disjoint() -> None:
    assert core_blocks(range(12), 4) == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    assert core_blocks(range(5), 2) == [(0, 1), (2, 3)]  # core 4 is left over
    assert core_blocks([0, 1, 3, 4], 2) == [(0, 1), (3, 4)]
    assert core_blocks([0, 2, 3], 2) == [(2, 3)]  # no block across a gap


def test_claims_in_one_host_are_disjoint(tmp_path: Path) -> None:
    s = _settings(tmp_path, tp=2)
    a, b = claim_cores(s, range(4)), claim_cores(s, range(4))
    assert (a.cores, b.cores) == ((0, 1), (2, 3))
    with pytest.raises(ConfigError) as exc:
        claim_cores(s, range(4))
    msg = str(exc.value)
    assert "4 cores make 2 block(s) of tp_degree 2" in msg and "at most 2 worker(s)" in msg
    a.release()
    c = claim_cores(s, range(4))
    assert c.cores == (0, 1)
    b.release()
    c.release()


def test_tp_larger_than_host(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs 8 contiguous NeuronCores, but this host offers 2"):
        claim_cores(_settings(tmp_path, tp=8), range(2))


CLAIM = textwrap.dedent("""
    import sys, time
    from handlers.config import NeuronSettings
    from handlers.backends.neuron_cores import claim_cores
    s = NeuronSettings(tp_degree=2, cores_per_instance=6, core_lock_dir=sys.argv[1])
    claim = claim_cores(s, range(6))
    print(",".join(map(str, claim.cores)), flush=True)
    sys.stdin.read()  # hold the block until the parent closes stdin
""")


def test_worker_processes_get_disjoint_blocks_until_they_exit(tmp_path: Path) -> None:
    locks = str(tmp_path / "locks")

    def start() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", CLAIM, locks], cwd=ROOT, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)

    workers = [start() for _ in range(3)]
    try:
        got = [w.stdout.readline().strip() for w in workers]
        assert sorted(got) == ["0,1", "2,3", "4,5"]
        extra = start()
        extra.stdin.close()
        assert extra.wait(timeout=30) != 0
        err = extra.stderr.read()
        assert "6 cores make 3 block(s) of tp_degree 2" in err and "at most 3 worker(s)" in err
        workers[1].stdin.close()  # a worker exits: the kernel frees its lock
        workers[1].wait(timeout=30)
        workers[1] = start()
        assert workers[1].stdout.readline().strip() == got[1]
    finally:
        for w in workers:
            if w.poll() is None:
                w.stdin.close()
                w.wait(timeout=30)
