"""One line, not a traceback, for each malformed request body in the worker log.

TorchServe's protocol code tries json.loads on every application/json body and, when it
fails, logs "Failed json decoding of input data. Forwarding encoded payload" with the
whole traceback (ts/protocol/otf_message_handler.py, _retrieve_input_data: a root-logger
warning with exc_info=True): a dozen model_log lines per bad request, which a client can
send at will. The handler answers such a body with a 400 naming the error; the log keeps
TorchServe's line with the exception's one-line summary.
"""

from __future__ import annotations

import logging

#: TorchServe 0.12's message (ts/protocol/otf_message_handler.py:L340-L343)
FAILED_JSON = "Failed json decoding of input data. Forwarding encoded payload"


class OneLineJsonFailure(logging.Filter):
    """Folds the traceback of TorchServe's JSON-decoding warning into its message."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == FAILED_JSON and record.exc_info:
            exc = record.exc_info[1]
            record.msg = f"{FAILED_JSON} ({type(exc).__name__}: {exc})"
            record.exc_info, record.exc_text = None, None
        return True


def install() -> None:
    """On the root logger, which TorchServe's protocol code logs to; once per process."""
    root = logging.getLogger()
    if not any(isinstance(f, OneLineJsonFailure) for f in root.filters):
        root.addFilter(OneLineJsonFailure())
