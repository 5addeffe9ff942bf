"""What runs on an Inf2 host runs on its Python, 3.10 included (`make test-py310` runs
this file, and a few runtime test files, under a real CPython 3.10; the main suite runs
it under 3.11).

The 3.10 environment has the runtime's pure-Python dependencies but no torch: PyPI's
Linux torch wheels are CUDA builds of several GB, and the Neuron SDK brings its own torch
on an Inf2 host. So every module imports here except those that import torch (or numpy,
its companion) at module level, which must fail on exactly that and nothing else -- a
3.11-only call at import time would still show up.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from functools import partial

import pytest

import archive_tools
import handlers
import neuron_cache
from handlers.config import parse_config
from handlers.errors import ConfigError

#: what a runtime module may lack here (the 3.10 check has no torch)
HEAVY = {"torch", "numpy"}


def _all_modules() -> list[str]:
    names = []
    for package in (neuron_cache, handlers, archive_tools):
        names.append(package.__name__)
        names += [m.name for m in pkgutil.walk_packages(package.__path__,
                                                        package.__name__ + ".")]
    return sorted(names)


@pytest.mark.parametrize("name", _all_modules())
def test_every_runtime_module_imports(name: str) -> None:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in HEAVY and not _has(exc.name):
            pytest.skip(f"needs {exc.name}, not installed in this interpreter")
        raise


def _has(module: str) -> bool:
    return importlib.util.find_spec(module.split(".")[0]) is not None


def _failing_backend(message: str):
    raise ConfigError(message)


def test_a_model_that_fails_to_load_in_the_engine_process_reaches_the_caller(tmp_path
                                                                              ) -> None:
    """The default child mode: the engine process's own exception (type and message), with
    its traceback text as the cause, never an AttributeError from the path reporting it
    (`BaseException.add_note` is 3.11+)."""
    from handlers.engine.client import EngineClient, RemoteTraceback
    from handlers.engine.start import EngineSpec
    from tests.unit.fakes import CharTokenizer

    config = parse_config({"handler": {"batch_size": 2, "engine_process": "child"}})
    spec = EngineSpec(config, tmp_path,
                      make_backend=partial(_failing_backend, "handler.checkpoint: no weights"),
                      make_tokenizer=CharTokenizer)
    with pytest.raises(ConfigError, match="handler.checkpoint: no weights") as info:
        EngineClient.launch(spec, None, capacity=4)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "raised in the engine process" in str(cause) and "_failing_backend" in str(cause)
    assert sys.version_info >= (3, 10)
