"""What TorchServe 0.12's async frontend makes of the messages a worker sends.

A fake of the Java side, so the handler's answers can be checked in milliseconds:
`decode` reads the worker's response messages as ModelResponseDecoder does, and
`http_view` applies RestJob's and AsyncBatchAggregator's rules to one request's
messages. The end-to-end tests check the same things against the real frontend.
Citations: pytorch/serve@v0.12.0:frontend/server/src/main/java/org/pytorch/serve/...
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

STREAM_NEXT = "ts_stream_next"


@dataclass
class Prediction:
    code: int  # the message's overall code
    request_id: str
    content_type: str
    status: int
    headers: dict[str, str]
    body: bytes


def decode(data: bytes) -> list[Prediction]:
    """Every prediction of every message in `data` (util/codec/ModelResponseDecoder.java:27-88)."""
    out, pos = [], 0

    def take(n: int) -> bytes:
        nonlocal pos
        pos += n
        return data[pos - n:pos]

    def integer() -> int:
        return struct.unpack("!i", take(4))[0]

    def text() -> str:
        return take(integer()).decode("utf-8")

    while pos < len(data):
        code = integer()
        text()  # the message
        while (length := integer()) != -1:
            request_id = take(length).decode("utf-8")
            content_type = text()
            status = integer()
            text()  # reason phrase
            headers = dict((text(), text()) for _ in range(integer()))
            out.append(Prediction(code, request_id, content_type, status, headers,
                                  take(integer())))
    return out


@dataclass
class HttpView:
    status: int | None = None  # None: no response head was ever sent
    headers: dict[str, str] = field(default_factory=dict)
    framing: str = ""  # content-length | chunked
    body: bytes = b""
    complete: bool = False  # the client saw the whole response
    forgotten: bool = False  # the frontend took the request out of jobs_in_backend


def http_view(predictions: list[Prediction]) -> HttpView:
    """One request's messages as its client and the frontend's in-flight map see them."""
    view, streams, closed = HttpView(), 0, False
    for p in predictions:
        # any other code errors every job in the map (AsyncBatchAggregator.java:121-137)
        assert p.code == 200
        next_ = p.headers.get(STREAM_NEXT)
        if next_ is not None:  # RestJob.java:148-153: true counts chunks, false ends (-1)
            streams = streams + 1 if next_ == "true" else -1
        if closed:  # later writes go to a closed channel
            pass
        elif streams == 0:  # a complete response (RestJob.java:175-177)
            _head(view, p, "content-length")
            view.body, view.complete = p.body, True
            closed = p.status >= 400  # NettyUtils.java:197-200: close after any error
        elif streams == 1:  # head, then the first chunk (RestJob.java:181-183)
            _head(view, p, "chunked")
            closed = p.status >= 400  # the close follows the head: the chunk is lost
            if not closed:
                view.body += p.body
        elif streams > 1:  # RestJob.java:184-185
            view.body += p.body
        else:  # -1: a chunk and the end, written whether or not a head went out (:178-180)
            if view.framing == "chunked":
                view.body += p.body
                view.complete = True
        if next_ == "false":  # AsyncBatchAggregator.java:112-118
            view.forgotten = True
    return view


def _head(view: HttpView, p: Prediction, framing: str) -> None:
    # RestJob.java:159-166: content type and every response header of this message
    view.status, view.framing = p.status, framing
    view.headers = {k.lower(): v for k, v in p.headers.items()}
    if p.content_type:
        view.headers["content-type"] = p.content_type
