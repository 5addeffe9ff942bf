"""`inf2serve compile`: fill an archive folder's neuron_cache/ ahead of deployment.

Production workers then load the compiled artifacts instead of compiling at
start-up (minutes per model). Compilation needs the Neuron SDK and runs the same
code path a worker runs (the neuron backend with its versioned compile cache),
so what is compiled here is exactly what a worker will look up.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

from archive_tools.load_checks import check_load, read_model_config
from handlers.config import ModelConfig
from handlers.errors import Inf2ServeError, NeuronUnavailableError

#: the SDK library each Neuron backend compiles with
SDK_PACKAGES = {"neuron": ("transformers_neuronx", "transformers-neuronx"),
                "nxdi": ("neuronx_distributed_inference", "neuronx-distributed-inference")}
#: what AWS's setup guides say to install, from AWS's package repository (the PyPI packages of
#: these names are placeholders; inf2serve itself is installed from its clone, not PyPI).
#: aws-neuron/aws-neuron-sdk@81ce03a: archive/transformers-neuronx/setup/index.txt:6 and
#: libraries/nxd-inference/nxdi-setup.rst:70
SDK_INSTALL = {
    "neuron": "pip install transformers-neuronx --extra-index-url=https://pip.repos.neuron.amazonaws.com",
    "nxdi": "pip install --upgrade neuronx-cc==2.* neuronx-distributed-inference "
            "--extra-index-url https://pip.repos.neuron.amazonaws.com",
}


def install_hint(backend: str) -> str:
    return (f"run it on an Inf2/Trn1 instance, in the Neuron SDK's virtual environment (Neuron "
            f"DLAMI or DLC), or install the SDK there: {SDK_INSTALL[backend]}")


def neuron_available(backend: str = "neuron") -> bool:
    return importlib.util.find_spec(SDK_PACKAGES[backend][0]) is not None


def load_archive_dir(archive: Path) -> ModelConfig:
    """The config of a no-archive folder (compile writes into it), after the load checks a
    worker runs and the tokenizer and config.json loaded as it loads them: an archive a
    worker would refuse is refused here, not after the compile."""
    if not archive.exists():
        raise Inf2ServeError(f"ARCHIVE_DIR {archive}: no such file or directory")
    if not archive.is_dir():
        raise Inf2ServeError(f"ARCHIVE_DIR {archive}: compile writes into the archive's "
                             "neuron_cache/, so it needs a folder; repackage with "
                             "`inf2serve package --format no-archive`")
    if not (archive / "MAR-INF" / "MANIFEST.json").is_file():
        raise Inf2ServeError(f"ARCHIVE_DIR {archive}: no MAR-INF/MANIFEST.json; pass a folder "
                             "written by `inf2serve package --format no-archive`")
    _, config, _ = read_model_config(archive / "model-config.yaml")
    if config.handler.backend not in SDK_PACKAGES:
        raise Inf2ServeError(f"{archive / 'model-config.yaml'}: handler.backend is "
                             f"{config.handler.backend!r}; only the Neuron backends (neuron, "
                             "nxdi) are compiled (set handler.backend and repackage)")
    return check_load(archive / "model-config.yaml", archive / config.handler.checkpoint,
                      fill_frontend=False, flag="ARCHIVE_DIR").config


def compile_archive(archive: Path, config: ModelConfig) -> str:
    """Compile (or find) the archive's model in its cache; returns a one-line summary.

    Goes through the archive's backend so the cache key is the one workers compute.
    """
    from handlers.backends import load_backend

    backend = load_backend(config.handler, archive.resolve())
    try:
        start = getattr(backend, "start", None)  # neuron_cache.compile.StartResult
        if start is None:
            return "compiled"
        verb = "compiled" if start.compiled else "already cached:"
        return f"{verb} {start.entry.name}"
    finally:
        backend.close()


def _run(args: argparse.Namespace) -> int:
    archive = Path(args.archive_dir)
    config = load_archive_dir(archive)
    n, h = config.handler.neuron, config.handler
    cache = archive / n.cache_dir
    print(f"compile {archive} ({h.backend}): tp_degree={n.tp_degree} batch_size={h.batch_size} "
          f"n_positions={h.max_length} amp={h.amp} -> {cache}")
    if args.dry_run:
        print("dry run: nothing compiled")
        return 0
    if not neuron_available(h.backend):
        raise NeuronUnavailableError(f"{SDK_PACKAGES[h.backend][1]} is not installed here, so "
                                     f"nothing can be compiled; {install_hint(h.backend)}")
    start = time.monotonic()
    summary = compile_archive(archive, config)
    print(f"{summary} in {time.monotonic() - start:.0f}s; cache entries: "
          f"inf2serve inspect {archive}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compile", help="pre-compile an archive folder's Neuron cache (needs the Neuron SDK)",
        description="Compile the model of a no-archive folder into its neuron_cache/, so "
        "production workers load instead of compiling at start-up. Needs an Inf2/Trn1 instance "
        "with the Neuron SDK."
        "\n\nexamples:\n  inf2serve package --config llama.yaml --checkpoint work/llama "
        "--name llama --format no-archive --out model_store\n"
        "  inf2serve compile model_store/llama\n  inf2serve inspect model_store/llama",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("archive_dir", metavar="ARCHIVE_DIR", help="archive folder (no-archive format)")
    p.add_argument("--dry-run", action="store_true", help="print what would be compiled")
    p.set_defaults(func=_run)
