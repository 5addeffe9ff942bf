"""TorchServe entry point of an inf2serve archive.

The toolkit's runtime travels inside the archive under runtime/ (so a stock
TorchServe with torch and transformers serves it); this file puts it on the path
and exposes the handler class TorchServe instantiates.
"""

import sys
from pathlib import Path

_RUNTIME = str(Path(__file__).resolve().parent / "runtime")
if _RUNTIME not in sys.path:
    sys.path.insert(0, _RUNTIME)

from handlers.generation_handler import GenerationHandler  # noqa: E402


class Inf2ServeHandler(GenerationHandler):
    """The archive's handler: config -> backend -> scheduler -> stream writer."""
