"""This worker's side of TorchServe 0.12's async protocol, without its per-request costs.

Under `asyncCommunication`, TorchServe runs the handler through its AsyncService
(pytorch/serve@v0.12.0:ts/async_service.py): a reader thread queues each request, a
second thread hands it to the event loop, `predict` deep-copies the model's whole
context (config, manifest, metric cache) and prints a debug line, and a third thread
sends the answer. Measured on the synthetic device (bench/device_bound.py's archive,
1-token requests, 32 closed-loop streams): ~2.4 ms of worker CPU per request, serial
under the GIL, so a burst of 32 arrivals waited ~80 ms for its first tokens. And that
sending thread writes the frontend's socket beside the handler's own chunk writes
(handlers/torchserve/generation_handler.py ChunkSender) with no common lock.

`WorkerService` speaks the same protocol through TorchServe's own decoder and encoder
(ts/protocol/otf_message_handler.py) with one reader thread; the event loop does the
rest, so every write to the socket comes from the loop's thread. Each request gets a
shallow copy of the context: TorchServe's per-request state lives in objects made per
request (request ids, RequestProcessor headers and statuses), and the metric cache is
copied shallowly so its request ids are the request's own. Errors answer as
TorchServe's `predict` does (ts/async_service.py:44-89). `install` swaps it in for the
rest of the worker's life (`handler.worker_service: torchserve` keeps TorchServe's).

It also tells whoever asked for it (`install(on_socket=...)`) the socket, before the first
request is read: the handler hands a duplicate to the worker's guardian
(handlers/engine/guardian.py), which answers for this worker if it dies, in messages
encoded here (`last_words`, `closing_message`); what `on_socket` returns, if anything, is
what every write goes through from then on (each counted, so that the guardian never
adds to a message the worker died writing).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from handlers.engine.guardian import one_request_message
from handlers.engine.messages import LastWords

logger = logging.getLogger(__name__)


def install(on_socket: Callable[[Any], Any] | None = None) -> bool:
    """Make TorchServe's async worker run `WorkerService`. Called from the handler's
    initialize, which runs inside the worker's model load; the worker builds its
    AsyncService right after the load, looking the name up in its own (__main__)
    namespace (ts/model_service_worker.py:206-234). False, changing nothing, where
    that is not the setup (another entry point, a TorchServe that already changed it).
    `on_socket` gets the socket to the frontend before the first request is read; what it
    returns (None: the socket itself) is what the worker writes to."""
    try:
        from ts import async_service
    except ImportError:
        return False
    main = sys.modules.get("__main__")
    if getattr(main, "AsyncService", None) is not async_service.AsyncService:
        return False
    main.AsyncService = (WorkerService if on_socket is None
                         else functools.partial(WorkerService, on_socket=on_socket))
    return True


def _receive(sock: Any, begun: Callable[[], None] | None = None) -> tuple[bytes, Any]:
    """One message from the frontend: TorchServe's decoder, without the INFO log line
    `retrieve_msg` writes per request (ts/protocol/otf_message_handler.py:26-42), which
    the frontend then reads, parses and logs again. `begun()` once its first byte is in,
    before any byte is taken off the socket: a worker killed between a read and the note
    that it began (the reader waits for the GIL after every read, milliseconds under load)
    would otherwise leave the socket inside a message while its board says it is not."""
    from ts.protocol import otf_message_handler as otf

    read_buffer = getattr(otf, "_retrieve_buffer", None)
    read_inference = getattr(otf, "_retrieve_inference_msg", None)
    if read_buffer is None or read_inference is None:  # a TorchServe without them
        return otf.retrieve_msg(sock)
    if begun is not None:
        if not sock.recv(1, socket.MSG_PEEK):  # waits for the message; takes nothing
            raise ValueError("Frontend disconnected")
        begun()
    cmd = read_buffer(sock, 1)
    if cmd != b"I":  # a load or unknown command is not expected after the load
        raise ValueError(f"unexpected command {cmd!r} from the frontend after the model loaded")
    return cmd, read_inference(sock)


#: a message this long or shorter is peeked whole before the worker takes any of it
PEEK_BYTES = 1 << 16
#: how much of a message's start the guardian is given to recognise it by (its request id)
HEAD_BYTES = 128


class _Incomplete(Exception):
    """The peeked bytes end before the message does."""


class _Peeked:
    """Bytes already peeked, read as TorchServe's decoder reads its socket."""

    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)
        self.taken = 0

    def recv(self, n: int) -> bytes:
        if self.taken >= len(self._data):
            raise _Incomplete
        chunk = self._data[self.taken:self.taken + n]
        self.taken += len(chunk)
        return bytes(chunk)


def _receive_noted(sock: Any, notes: Any) -> Any:
    """One message, noted with the guardian before any of it leaves the socket: peeked,
    decoded from the peeked bytes, noted with its first bytes and length (`noting`), then
    taken off in one read (`taken`). A worker killed in between leaves the guardian a
    socket it can read: the message is still there, or wholly gone (guardian.Farewell.
    settle). A message longer than PEEK_BYTES, or still arriving, is read as before
    (`_receive`: the board says `reading` throughout)."""
    from ts.protocol import otf_message_handler as otf

    read_inference = getattr(otf, "_retrieve_inference_msg", None)
    data = sock.recv(PEEK_BYTES, socket.MSG_PEEK)  # waits for a message; takes nothing
    if not data:
        raise ValueError("Frontend disconnected")
    peeked = _Peeked(data)
    try:
        cmd = peeked.recv(1)
        if cmd != b"I" or read_inference is None:
            raise _Incomplete
        batch = read_inference(peeked)
    except _Incomplete:
        _, batch = _receive(sock, notes.reading)
        notes.read([_request_id(item) for item in batch])
        return batch
    length = peeked.taken
    notes.noting([_request_id(item) for item in batch], data[:HEAD_BYTES], length)
    # all of it is in the socket's buffer already: one read takes it whole
    if len(sock.recv(length, socket.MSG_WAITALL)) != length:
        raise ValueError("Frontend disconnected")
    notes.taken()
    return batch


def _request_id(item: dict) -> str:
    """A decoded request's id (ts/service.py retrieve_data_for_inference reads it so)."""
    rid = item.get("requestId", b"")
    return bytes(rid).decode("utf-8") if isinstance(rid, (bytes, bytearray)) else str(rid)


class WorkerService:
    """Replaces ts.async_service.AsyncService (same constructor and `run` contract:
    returns the error text when the connection to the frontend ends)."""

    def __init__(self, service: Any, on_socket: Callable[[Any], Any] | None = None) -> None:
        self.service = service
        self._on_socket = on_socket
        self.loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()  # the loop keeps only weak references
        self._ended: asyncio.Future[str] | None = None

    def run(self) -> str | None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(self._main())

    async def _main(self) -> str:
        self.loop = asyncio.get_running_loop()
        self._ended = self.loop.create_future()
        sock = self.service.cl_socket
        notes: Any = None
        if self._on_socket is not None:
            try:
                writes = self._on_socket(sock)
            except Exception:  # serving goes on; only the worker's death would hang requests
                logger.exception("handing TorchServe's socket over failed")
            else:
                if writes is not None:
                    self.service.cl_socket = writes  # what `_predict` and the handler write to
                    notes = writes if hasattr(writes, "sendall_final") else None
        threading.Thread(target=self._read, args=(sock, notes), name="inf2serve-ts-reader",
                         daemon=True).start()
        logger.info("serving TorchServe's async protocol with inf2serve's worker service")
        return await self._ended

    def _read(self, sock: Any, notes: Any = None) -> None:
        """The reader thread: each request to the loop, as it arrives. `notes` (an exact
        guardian's socket, handlers/engine/guardian.GuardedWrites): each message's start
        and its requests noted, before anything of them can be answered."""
        try:
            while True:
                if notes is None:
                    _, batch = _receive(sock)
                else:
                    batch = _receive_noted(sock, notes)
                self.loop.call_soon_threadsafe(self._start, batch)
        except BaseException:  # the frontend went away (or sent garbage): the worker ends
            self.loop.call_soon_threadsafe(self._end, traceback.format_exc())

    def _end(self, error: str) -> None:
        if not self._ended.done():
            self._ended.set_result(error)

    def _start(self, batch: list[dict]) -> None:
        task = self.loop.create_task(self._predict(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _predict(self, batch: list[dict]) -> None:
        from ts.protocol.otf_message_handler import create_predict_response
        from ts.service import PREDICTION_METRIC, PredictionException, Service

        service = self.service
        try:
            headers, inputs, ids = Service.retrieve_data_for_inference(batch)
        except Exception:  # TorchServe's predict does not survive this either
            logger.exception("could not decode a request from the frontend")
            return
        context = self._request_context(ids, headers)
        start = time.time()
        try:
            ret = await service._entry_point(inputs, context)
        except MemoryError:
            logger.error("System out of memory", exc_info=True)
            response = create_predict_response(None, ids, "Out of resources", 507)
        except PredictionException as exc:
            logger.error("Prediction error", exc_info=True)
            response = create_predict_response(None, ids, exc.message, exc.error_code)
        except Exception as exc:
            if "CUDA" in str(exc):  # out of device memory, as TorchServe tells it
                logger.error("CUDA out of memory", exc_info=True)
                response = create_predict_response(None, ids, "Out of resources", 507)
            else:
                logger.warning("Invoking custom service failed.", exc_info=True)
                response = create_predict_response(None, ids, "Prediction failed", 503)
        else:
            if not isinstance(ret, list) or len(ret) != len(inputs):
                logger.warning("model %s returned %r for %d requests", context.model_name,
                               type(ret), len(inputs))
                response = create_predict_response(
                    None, ids, "Invalid model predict output", 503)
            else:
                context.metrics.add_time(PREDICTION_METRIC,
                                         round((time.time() - start) * 1000, 2))
                response = create_predict_response(ret, ids, "Prediction success", 200,
                                                   context=context)
        if response is not None:  # None on ranks other than 0 (nothing to send)
            try:
                final = getattr(service.cl_socket, "sendall_final", None)
                if final is not None:  # every request of the batch ends with this write
                    final(response, list(ids.values()))
                else:
                    service.cl_socket.sendall(response)
            except OSError:  # the frontend went away; the reader thread ends the worker
                logger.exception("sending a response to the frontend failed")

    def _request_context(self, ids: dict[int, str], headers: list[Any]) -> Any:
        """The model's context with this request's ids and headers (see the module doc)."""
        base = self.service.context
        context = copy.copy(base)
        context.request_ids = ids
        context.request_processor = headers
        context.cl_socket = self.service.cl_socket
        metrics = copy.copy(base.metrics)
        metrics.request_ids = ids
        context.metrics = metrics
        return context


# -- what the engine process says for this worker if it dies ----------------------------

class _Reply:
    """The parts of a request's Context that TorchServe's encoder reads for one prediction
    (ts/protocol/otf_message_handler.py:95-120)."""

    stopping_criteria = None

    def __init__(self, content_type: str, status: int, headers: dict[str, str]) -> None:
        self.content_type, self.status, self.headers = content_type, status, headers

    def get_response_content_type(self, idx: int) -> str:
        return self.content_type

    def get_response_status(self, idx: int) -> tuple[int, str]:
        return self.status, ""

    def get_response_headers(self, idx: int) -> dict[str, str]:
        return self.headers

    def set_response_header(self, idx: int, key: str, value: str) -> None:
        self.headers[key] = value


@functools.lru_cache(maxsize=64)
def _prediction_tail(content_type: str, status: int, stream_next: str | None,
                     body: str) -> bytes | None:
    """One prediction as TorchServe's encoder writes it (otf_message_handler.py:79-135), from
    after its request id: the same for every request of a kind, whose id goes in front.
    None where this rank sends nothing (LOCAL_RANK != 0, :69-70)."""
    from ts.protocol.otf_message_handler import create_predict_response

    headers = {} if stream_next is None else {"ts_stream_next": stream_next}
    msg = create_predict_response({0: body}, {0: ""}, "", 200,
                                  _Reply(content_type, status, headers),
                                  ts_stream_next=stream_next == "true")
    # after the code, the empty message and the empty id; before the end of the list
    return None if msg is None else bytes(msg[12:-4])


def last_words(request_id: str, content_type: str, whole: str,
               in_stream: str | None) -> LastWords | None:
    """What the engine process writes to the frontend for this request if the worker dies.

    `silent` (no text went out): a complete response, then `ts_stream_next: false` to take
    the request out of the frontend's map -- what StreamWriter.fail sends. `spoken` (a
    stream that may have started): a message saying `ts_stream_next: true`, then the error
    with `false`. On a started stream that is an empty chunk, then the error as its last
    chunk (frontend/server/src/main/java/org/pytorch/serve/job/RestJob.java:148-186); on a
    stream whose first chunk had not gone out after all, a 500 head, after which the
    frontend closes the connection (util/NettyUtils.java:197-200): an error either way.
    `in_stream` None: not streamed, `silent` only. None where this rank sends nothing."""
    end = _prediction_tail("", 200, "false", "")
    whole_tail = _prediction_tail("application/json", 500, None, whole)
    if end is None or whole_tail is None:
        return None
    spoken = None
    if in_stream is not None:
        spoken = one_request_message(request_id, [_prediction_tail(content_type, 500, "true", ""),
                                       _prediction_tail(content_type, 500, "false", in_stream)])
    return LastWords(request_id, one_request_message(request_id, [whole_tail, end]), spoken)


def silent_tails(whole: str) -> tuple[bytes, ...] | None:
    """The predictions of `last_words`' silent answer, for any request id: a whole 500 with
    body `whole`, then the end (handlers/engine/guardian.py puts an id in front of each)."""
    end = _prediction_tail("", 200, "false", "")
    whole_tail = _prediction_tail("application/json", 500, None, whole)
    if end is None or whole_tail is None:
        return None
    return (whole_tail, end)


def closing_message(text: str) -> bytes:
    """A message with a code other than 200: TorchServe's async frontend errors every request
    it still has in flight on this worker with it (wlm/AsyncBatchAggregator.java:121-137: a
    500 with `text` where nothing went out yet; a stream that had started is cut off, the
    frontend closing its connection after the error it cannot send: util/NettyUtils.java:
    197-200)."""
    from ts.protocol.otf_message_handler import create_predict_response

    msg = create_predict_response(None, {}, text, 500)
    return b"" if msg is None else bytes(msg)
