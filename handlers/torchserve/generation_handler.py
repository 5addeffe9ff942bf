"""The TorchServe handler: thin glue from TorchServe's API to the generation service.

Runs under `asyncCommunication: true` with `batchSize: 1`: TorchServe hands each
request over as it arrives and each one is its own coroutine here, streaming its
chunks with `send_intermediate_predict_response` and ending its stream the moment
it finishes -- whatever else is running. Batching, micro or continuous, happens in
the engine thread behind `GenerationService`, not in TorchServe's frontend (whose
batch would keep every stream open until the slowest request ends).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
import time
from functools import partial
from pathlib import Path
from typing import Any

from handlers.api.framing import Framer, error_body, native_framer
from handlers.api.native import Immediate, NativeApi
from handlers.api.request import decode_body
from handlers.api.routes import select_api
from handlers.backends.base import Backend
from handlers.checkpoint_checks import load_worker_config
from handlers.config import ModelConfig
from handlers.engine import guardian
from handlers.engine.client import LAST_WORDS, EngineClient
from handlers.engine.core import Observer
from handlers.engine.messages import LastWords
from handlers.engine.scheduler import ErrorEvent, FinishEvent, TextEvent
from handlers.errors import CapacityError, RequestError
from handlers.torchserve import log_filters, worker_service
from handlers.torchserve.cancel_peers import CancelPeers
from handlers.torchserve.metrics import MetricsReporter, recorder_for, worker_id
from handlers.torchserve.service import GenerationService

logger = logging.getLogger(__name__)

#: the response header TorchServe 0.12 reads to tell a stream's chunks from its end
TS_STREAM_NEXT = "ts_stream_next"
#: what `send_intermediate_predict_response` says in a message's header
INTERMEDIATE = "Intermediate"
#: the OpenAI router (archive_tools/openai_router.py) names each request it forwards with
#: this header, and POSTs {"client_id"} to CANCEL_PATH when that request's client leaves
CLIENT_ID_HEADER = "x-inf2serve-client-id"
CANCEL_PATH = "inf2serve/cancel"
#: what a request hears when the TorchServe worker process dies under it
WORKER_DIED = ("the TorchServe worker process died; it is being restarted, retry the request "
               "once it is back (seconds, or the model's load time)")


class ChunkSender:
    """Streamed chunks of every request on one TorchServe socket: one message and one
    `sendall` per event-loop iteration, not one per chunk.

    A message to the frontend holds a list of predictions, each with its request id,
    status, headers and body (pytorch/serve@v0.12.0:ts/protocol/otf_message_handler.py:
    56-155), and the async frontend answers every job in the list (frontend/server/src/
    main/java/org/pytorch/serve/wlm/AsyncBatchAggregator.java:80-119). A step's events
    reach the event loop in one callback, so its chunks leave together, sent at the
    start of the next iteration; a request's text of several steps, if the loop fell
    behind, goes as one chunk."""

    _HEAD = struct.pack("!ii", 200, len(INTERMEDIATE)) + INTERMEDIATE.encode()
    _END = struct.pack("!i", -1)

    def __init__(self, sock: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.sock, self.loop = sock, loop
        self._pending: list[StreamWriter | bytes] = []

    def add(self, item: StreamWriter | bytes) -> None:
        """A prediction's bytes, or a writer holding text: sent with this iteration's."""
        if not self._pending:
            self.loop.call_soon(self._flush_logged)
        self._pending.append(item)

    def flush(self) -> None:
        """Send what is pending now: before a stream's end, which TorchServe sends itself."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        parts = []
        for item in pending:
            if isinstance(item, bytes):
                parts.append(item)
                continue
            try:
                part = item.take()
            except Exception:  # one request's failure must not cost the others theirs
                logger.exception("framing a chunk of request %s failed", item.request_id)
                continue
            if part is not None:
                parts.append(part)
        if parts:
            self.sock.sendall(b"".join([self._HEAD, *parts, self._END]))

    def _flush_logged(self) -> None:
        try:
            self.flush()
        except Exception:  # the frontend's socket failed: TorchServe ends this worker
            logger.exception("sending streamed chunks to the frontend failed")

    @classmethod
    def prediction(cls, message: bytes) -> bytes:
        """The one prediction of a message `create_predict_response` made."""
        return message[len(cls._HEAD):-len(cls._END)]


class StreamWriter:
    """Writes one request's answer through TorchServe 0.12: status, headers, chunks.

    TorchServe's async frontend forgets a request only when a message for it says
    `ts_stream_next: false` (AsyncBatchAggregator.java:112-118); any other answer stays
    in its in-flight map for good. So every answer ends that way:
    - a success, streamed or not: one or more chunks (`ts_stream_next: true`; the
      first carries status and headers), then the value `handle` returns, which
      TorchServe sends with the header turned to false (otf_message_handler.py:95-103):
      on the wire, a chunked 200;
    - an error before any chunk: a complete response (Content-Length), then an empty
      message saying `ts_stream_next: false` that only takes the request out of the
      map: TorchServe closes the connection after the head of any status >= 400
      (NettyUtils.java:197), so a chunked error would lose its body, and a stream's
      first message cannot end it (RestJob.java:148-186 sends no head then).
    Citations: pytorch/serve@v0.12.0, under frontend/server/src/main/java/org/pytorch/
    serve/ ({wlm,job,util}/) and ts/protocol/.
    """

    def __init__(self, context: Any, idx: int, sender: ChunkSender) -> None:
        self.context = context
        self.idx = idx
        self.sender = sender
        self.framer: Framer | None = None
        self.started = False  # a chunk went out, or is queued in the sender
        self._text: list[str] = []  # streamed text not yet framed
        self._tokens: int | None = None  # tokens generated up to its end, when counted
        #: a chunk's prediction up to its body: the same for every chunk after the first
        self._prefix: bytes | None = None

    @property
    def request_id(self) -> str:
        return self.context.get_request_id(self.idx)

    def begin(self, framer: Framer) -> None:
        self.framer = framer
        self.context.set_response_content_type(self.idx, framer.content_type)

    def add_text(self, text: str, tokens: int | None = None) -> None:
        """Generated text (and, for a framer that counts them, the tokens generated up to
        its end), framed and sent with this event-loop iteration's chunks (none for a
        non-streamed answer, whose last piece carries it all). Called on the loop's
        thread, straight from the engine's events: no coroutine wakes per token.

        This is the one path every piece of text takes, whichever way it arrived: framed
        in the order it was added, and all of it before the answer's end (`end`)."""
        if text and self.framer.streaming:
            if not self._text:
                self.sender.add(self)
            self._text.append(text)
            if tokens is not None:
                self._tokens = tokens

    def take(self) -> bytes | None:
        """The text added since the last call, as one chunk's prediction (ChunkSender);
        None when there is none, or the framer holds it back (a possible tool call)."""
        text, self._text = "".join(self._text), []
        if not text:
            return None
        if self._tokens is not None:  # the counts the chunk holding this text carries
            self.framer.tokens = self._tokens
        payload = self.framer.chunk(text)
        return self._part(payload) if payload else None

    def send(self, payload: str) -> None:
        """One chunk of a streamed 200 (nothing to send: nothing goes out)."""
        if payload and (part := self._part(payload)) is not None:
            self.sender.add(part)

    def end(self, event: FinishEvent) -> str:
        """The answer's end: the text added before it framed and sent first, then the
        framer's final piece (which may release text it held back)."""
        self.sender.flush()
        return self.finish(self.framer.final(event))

    def end_with_error(self, status: int, message: str, retry_after_s: int = 0,
                       field: str = "") -> str:
        """A failure, in the answer's own format (a native JSON error before one is
        known): in the stream if a chunk went out (the text before it first), else a
        proper HTTP status."""
        framer = self.framer or native_framer(False, "")
        self.sender.flush()
        if self.started:
            return self.finish(framer.error(status, message, field or None, in_stream=True))
        retry = {"Retry-After": str(retry_after_s)} if retry_after_s else None
        return self.fail(status, framer.error(status, message, field or None), retry)

    def finish(self, last: str) -> str:
        """The answer's last piece; returned to TorchServe, which ends the stream with it.
        A body that never streamed (non-streamed JSON, an empty stream, a stream whose
        text the framer held to the end) goes out as the stream's one chunk first."""
        if not self.started:
            if (part := self._part(last)) is not None:
                self.sender.add(part)
            last = ""
        self.sender.flush()  # every chunk before the end (TorchServe sends it, later)
        return last

    def fail(self, status: int, body: str, headers: dict[str, str] | None = None) -> str:
        """An error before any chunk went out: a proper HTTP status and JSON body."""
        context, idx = self.context, self.idx
        context.set_response_status(status, "", idx)
        context.set_response_content_type(idx, "application/json")
        for key, value in (headers or {}).items():
            context.set_response_header(idx, key, value)
        self._complete(body)
        context.set_response_header(idx, TS_STREAM_NEXT, "false")
        return ""

    def _part(self, payload: str) -> bytes | None:
        """What `send_intermediate_predict_response` sends (ts/handler_utils/utils.py:36-42),
        as one prediction of a message (None: nothing to send). The first chunk is
        encoded by TorchServe itself (status, content type, headers with
        `ts_stream_next: true`); later ones reuse its bytes up to the body."""
        self.started = True
        body = payload.encode("utf-8")
        if self._prefix is not None:
            return b"".join((self._prefix, struct.pack("!i", len(body)), body))
        from ts.protocol.otf_message_handler import create_predict_response

        req = {self.idx: self.context.get_request_id(self.idx)}
        msg = create_predict_response({self.idx: body}, req, INTERMEDIATE, 200, self.context,
                                      True)
        if msg is None:  # ranks other than 0 send nothing (utils.py:39-40)
            return None
        part = ChunkSender.prediction(bytes(msg))
        self._prefix = part[:len(part) - 4 - len(body)]
        return part

    def _complete(self, body: str) -> None:
        """A whole response in one message: no `ts_stream_next` header."""
        from ts.protocol.otf_message_handler import create_predict_response

        req = {self.idx: self.context.get_request_id(self.idx)}
        msg = create_predict_response({self.idx: body}, req, "", 200, self.context)
        if msg is not None:  # None on ranks other than 0, as for intermediate responses
            self.context.cl_socket.sendall(msg)


class GenerationHandler:
    """config -> backend -> scheduler -> stream writer."""

    def __init__(self) -> None:
        self.service: GenerationService | None = None
        self.initialized = False
        self._sender: ChunkSender | None = None
        self._handed_over = False  # the guardian answers for this worker if it dies
        #: how the guardian starts a worker on this one's socket if it dies (takeover.py)
        self._takeover: dict[str, Any] | None = None
        #: the model's other workers, asked for a request the router cancels and this one
        #: does not run (TorchServe gives the cancel to any worker)
        self._peers: CancelPeers | None = None

    def initialize(self, context: Any) -> None:
        log_filters.install()  # a malformed body: one log line, not a traceback
        model_dir = Path(context.system_properties["model_dir"])
        # the checks `package` ran, run again on the archive: refused here, before any load
        config = load_worker_config(context.model_yaml_config, model_dir)
        if (config.handler.worker_service == "inf2serve"
                and worker_service.install(on_socket=self._hand_over)):
            logger.info("TorchServe's async requests run through "
                        "handlers/torchserve/worker_service.py")
        overridden = type(self).make_backend is not GenerationHandler.make_backend
        self.service = GenerationService.create(
            config, model_dir, self._observer(context, config),
            make_backend=partial(_subclass_backend, type(self), config, model_dir)
            if overridden else None)
        self._peers = CancelPeers.open(model_dir, self.service.cancel_client)
        self._takeover = takeover_params(context, config.handler.worker_takeover)
        self.initialized = True

    def make_backend(self, config: ModelConfig, model_dir: Path) -> Backend | None:
        """None = the configured backend; a subclass may wrap or replace it (tests do).

        Called on the engine thread, which runs every model call: with
        handler.engine_process child, on a fresh instance of the subclass in the engine
        process (so the subclass must be importable there, as a handler module is)."""
        return None

    async def handle(self, data: list[dict], context: Any) -> list[str]:
        sender = self._sender_for(context.cl_socket)

        async def one(idx: int, item: dict) -> str:
            writer = StreamWriter(context, idx, sender)
            try:
                return await self.serve_one(writer, item)
            except Exception:  # an exception here would fail every in-flight request
                logger.exception("request %s failed", context.get_request_id(idx))
                return writer.end_with_error(500, "internal error; the worker log has the "
                                             "details")

        return list(await asyncio.gather(*(one(i, item) for i, item in enumerate(data))))

    async def serve_one(self, writer: StreamWriter, item: dict) -> str:
        context, idx = writer.context, writer.idx
        framer: Framer = NativeApi.error_framer
        url_path = (context.get_request_header(idx, "url_path") or "").strip("/")
        if url_path == CANCEL_PATH:
            return await self._cancel(writer, _payload(item))
        try:
            api = select_api(url_path)
            framer = api.error_framer
            prepared = api.prepare(_payload(item), _content_type(context, idx), self.service)
            if isinstance(prepared, Immediate):
                context.set_response_content_type(idx, prepared.content_type)
                return writer.finish(prepared.body)
            framer = prepared.framer
            writer.begin(framer)
            # a framer that counts tokens per chunk (OpenAI continuous usage) reads the
            # text events in `stream`; every other answer's text skips the coroutine
            counting = getattr(framer, "counts_tokens", False)
            words = LAST_WORDS.set(_last_words(writer.request_id, framer)
                                   if self._handed_over else None)
            try:
                events = self.service.submit(context.get_request_id(idx), prepared.request,
                                             prepared.prompt_ids, asyncio.get_running_loop(),
                                             on_text=None if counting else writer.add_text)
            finally:
                LAST_WORDS.reset(words)
        except RequestError as exc:
            return writer.fail(exc.status, framer.error(exc.status, exc.message, exc.field))
        except CapacityError as exc:
            return writer.fail(503, framer.error(503, str(exc)),
                               {"Retry-After": str(exc.retry_after_s)})
        client_id = _header(context, idx, CLIENT_ID_HEADER)
        if client_id:
            self.service.clients[client_id] = context.get_request_id(idx)
        try:
            return await self.stream(writer, framer, events)
        except BaseException:  # the coroutine was cancelled or the socket failed: free the slot
            self.service.engine.cancel(context.get_request_id(idx))
            raise
        finally:
            if client_id:
                self.service.clients.pop(client_id, None)

    async def _cancel(self, writer: StreamWriter, payload: Any) -> str:
        """The router's word that a client left: {"client_id"} -> {"cancelled": bool}; the
        request may run on another worker of the model (`CancelPeers`)."""
        try:
            client_id = decode_body(payload, "application/json").get("client_id")
            if not isinstance(client_id, str):
                raise RequestError("client_id", "expected {\"client_id\": \"...\"}")
        except RequestError as exc:
            return writer.fail(exc.status, json.dumps(error_body(exc.status, exc.message,
                                                                 exc.field)))
        cancelled = self.service.cancel_client(client_id)
        if not cancelled and self._peers is not None:
            cancelled = await self._peers.ask(client_id)
        writer.context.set_response_content_type(writer.idx, "application/json")
        return writer.finish(json.dumps({"cancelled": cancelled}))

    async def stream(self, writer: StreamWriter, framer: Framer, events: asyncio.Queue) -> str:
        """Wait for the sequence's end; the return value is the last piece.

        Text reaches `writer.add_text` without waking this coroutine (the service calls
        it); a queue that carries text too (a sink without that callback, or a framer
        that counts tokens) is read here. Either way the writer frames it in order and
        before the end; text that queued up goes out as one chunk: fewer, larger chunks
        when the engine outruns the socket, the same text.
        """
        counting = getattr(framer, "counts_tokens", False)
        while True:
            batch = [await events.get()]
            while not events.empty():
                batch.append(events.get_nowait())
            for event in batch:
                if isinstance(event, TextEvent):
                    writer.add_text(event.text, event.tokens if counting else None)
            end = batch[-1]
            if isinstance(end, FinishEvent):
                return writer.end(end)
            if isinstance(end, ErrorEvent):
                return writer.end_with_error(end.status, end.message, end.retry_after_s,
                                             end.field)

    def _hand_over(self, sock: Any) -> Any:
        """TorchServe's socket to the worker's guardian, which answers this worker's requests
        on it if the worker dies (handlers/engine/guardian.py); returns the socket to write
        through (None: `sock` itself). Inline, the model dies with the worker: nobody is
        left to answer."""
        engine = self.service.engine if self.service is not None else None
        if not isinstance(engine, EngineClient):
            guardian.signal_ready()
            return None
        writes = engine.hand_over(sock, worker_service.closing_message(WORKER_DIED),
                                  worker_service.silent_tails(
                                      native_framer(False, "").error(500, WORKER_DIED)),
                                  self._takeover)
        self._handed_over = True
        guardian.signal_ready()  # a worker that took a dead one's socket over serves now
        return writes

    def _sender_for(self, sock: Any) -> ChunkSender:
        """The worker's one sender (one socket, one event loop; tests bring their own)."""
        loop = asyncio.get_running_loop()
        if self._sender is None or self._sender.sock is not sock or self._sender.loop is not loop:
            self._sender = ChunkSender(sock, loop)
        return self._sender

    @staticmethod
    def _observer(context: Any, config: ModelConfig) -> Observer:
        """Engine observations -> the server's metrics (vLLM's names, for the router's
        /metrics) and TorchServe custom metrics, by the thread of
        handlers/torchserve/metrics.py (TorchServe's metric objects log a line per update)."""
        from ts.metrics.metric_type_enum import MetricTypes

        types = {"counter": MetricTypes.COUNTER, "gauge": MetricTypes.GAUGE}
        cache: dict[str, Any] = {}

        def emit(name: str, unit: str, kind: str, value: float, labels: dict[str, str]) -> None:
            if name not in cache:
                cache[name] = context.metrics.add_metric_to_cache(name, unit, list(labels),
                                                                  types[kind])
            cache[name].add_or_update(value, list(labels.values()))

        worker = worker_id()
        recorder = recorder_for(context.model_name, worker, config.handler.batch_size,
                                config.handler.max_length)
        return MetricsReporter(emit, context.model_name, worker,
                               recorder=recorder).start().observe


def _subclass_backend(cls: type[GenerationHandler], config: ModelConfig,
                      model_dir: Path) -> Backend | None:
    """A handler subclass's backend, built where the engine runs (picklable: a partial)."""
    return cls().make_backend(config, model_dir)


def takeover_params(context: Any, enabled: bool = True) -> dict[str, Any] | None:
    """What TorchServe's load request gave this worker (ts/model_service_worker.py:84-160),
    for a worker that takes its socket over (handlers/torchserve/takeover.py); None where
    the context lacks any of it (not a TorchServe worker's) or the config turned the
    takeover off (handler.worker_takeover false: TorchServe restarts the worker)."""
    if not enabled:
        return None
    try:
        props, model = context.system_properties, context.manifest["model"]
        metrics_config = context.metrics.config_file_path
        timeout_s = float((context.model_yaml_config or {}).get("startupTimeout", 120))
        return {"root": str(Path(__file__).resolve().parents[2]),
                "model_name": context.model_name, "model_dir": str(props["model_dir"]),
                "handler": model.get("handler"), "envelope": model.get("envelope"),
                "gpu": props.get("gpu_id"), "batch_size": props.get("batch_size"),
                "limit_max_image_pixels": props.get("limit_max_image_pixels", True),
                "metrics_config": metrics_config, "timeout_s": timeout_s,
                "worker_id": worker_id(),
                "serving_since": time.time(), "short_lived": int(
                    os.environ.get(guardian.SHORT_LIVED_ENV, -1))}
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def _last_words(request_id: str, framer: Framer) -> LastWords | None:
    """The request's answer if the worker dies: its framer's 500, whole or in its stream."""
    in_stream = framer.error(500, WORKER_DIED, in_stream=True) if framer.streaming else None
    return worker_service.last_words(request_id, framer.content_type,
                                     framer.error(500, WORKER_DIED), in_stream)


def _header(context: Any, idx: int, name: str) -> str:
    """A request header, whatever case the client sent its name in."""
    try:
        headers = context.get_all_request_header(idx) or {}
    except (AttributeError, IndexError, TypeError):
        return ""
    for key, value in headers.items():
        if isinstance(key, str) and key.lower() == name:
            return value.decode() if isinstance(value, bytes) else str(value)
    return ""


def _payload(item: dict) -> Any:
    for key in ("data", "body"):
        if key in item:
            return item[key]
    return None


def _content_type(context: Any, idx: int) -> str:
    """The body's content type: TorchServe files it under the parameter, else the header."""
    try:
        props = context.request_processor[idx].get_request_properties()
    except (AttributeError, IndexError, TypeError):
        return ""
    for key in ("data", "body"):
        if isinstance(props.get(key), dict):
            return str(props[key].get("content-type", ""))
    return _header(context, idx, "content-type")
