"""A malformed JSON body costs one worker-log line, not TorchServe's traceback."""

from __future__ import annotations

import io
import logging
import socket
import struct

from handlers.torchserve import log_filters


def frame(*parts: bytes) -> bytes:
    """TorchServe's input-data frame: each part as a big-endian int length, then bytes."""
    return b"".join(struct.pack("!i", len(p)) + p for p in parts)


def test_torchserves_json_warning_is_one_line() -> None:
    from ts.protocol.otf_message_handler import _retrieve_input_data

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    root.addHandler(handler)
    log_filters.install()
    log_filters.install()  # once, however often the handler starts
    a, b = socket.socketpair()
    try:
        a.sendall(frame(b"body", b"application/json", b'{"prompt": "hi",'))
        data = _retrieve_input_data(b)  # TorchServe's own code, as the worker runs it
    finally:
        a.close()
        b.close()
        root.removeHandler(handler)
        root.filters = [f for f in root.filters
                        if not isinstance(f, log_filters.OneLineJsonFailure)]
    assert data["value"] == b'{"prompt": "hi",'  # forwarded as bytes: the handler answers 400
    assert stream.getvalue() == (f"{log_filters.FAILED_JSON} (JSONDecodeError: Expecting "
                                 "property name enclosed in double quotes: line 1 column 17 "
                                 "(char 16))\n")
