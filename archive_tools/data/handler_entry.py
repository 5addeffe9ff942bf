"""TorchServe entry point of an inf2serve archive.

The toolkit's runtime travels inside the archive under runtime/ (so a stock
TorchServe with torch and transformers serves it); this file puts it on the path
and exposes the handler class TorchServe instantiates: the stock one, or the one
subclass of GenerationHandler in the user's module (`inf2serve package --handler`),
which sits at the top of the archive, on TorchServe's path. TorchServe takes the one
class this module defines (ts/model_loader.py _get_class_entry_point).
"""

import importlib
import inspect
import sys
from pathlib import Path

_RUNTIME = str(Path(__file__).resolve().parent / "runtime")
if _RUNTIME not in sys.path:
    sys.path.insert(0, _RUNTIME)

from handlers.torchserve.generation_handler import GenerationHandler  # noqa: E402

#: the module of `inf2serve package --handler FILE`; "" = the stock handler
USER_HANDLER = ""


def _user_class(module_name: str) -> type:
    """The module's one GenerationHandler subclass that no other of its classes extends."""
    module = importlib.import_module(module_name)
    ours = [c for _, c in inspect.getmembers(module, inspect.isclass)
            if c.__module__ == module.__name__ and issubclass(c, GenerationHandler)]
    leaves = [c for c in ours if not any(o is not c and issubclass(o, c) for o in ours)]
    if len(leaves) != 1:
        raise TypeError(f"{module_name}.py: expected one subclass of GenerationHandler, found "
                        f"{[c.__name__ for c in leaves]}")
    return leaves[0]


_Base = _user_class(USER_HANDLER) if USER_HANDLER else GenerationHandler


class Inf2ServeHandler(_Base):
    """The archive's handler: config -> backend -> scheduler -> stream writer."""
