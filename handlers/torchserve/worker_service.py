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
"""

from __future__ import annotations

import asyncio
import copy
import logging
import sys
import threading
import time
import traceback
from typing import Any

logger = logging.getLogger(__name__)


def install() -> bool:
    """Make TorchServe's async worker run `WorkerService`. Called from the handler's
    initialize, which runs inside the worker's model load; the worker builds its
    AsyncService right after the load, looking the name up in its own (__main__)
    namespace (ts/model_service_worker.py:206-234). False, changing nothing, where
    that is not the setup (another entry point, a TorchServe that already changed it)."""
    try:
        from ts import async_service
    except ImportError:
        return False
    main = sys.modules.get("__main__")
    if getattr(main, "AsyncService", None) is not async_service.AsyncService:
        return False
    main.AsyncService = WorkerService
    return True


def _receive(sock: Any) -> tuple[bytes, Any]:
    """One message from the frontend: TorchServe's decoder, without the INFO log line
    `retrieve_msg` writes per request (ts/protocol/otf_message_handler.py:26-42), which
    the frontend then reads, parses and logs again."""
    from ts.protocol import otf_message_handler as otf

    read_buffer = getattr(otf, "_retrieve_buffer", None)
    read_inference = getattr(otf, "_retrieve_inference_msg", None)
    if read_buffer is None or read_inference is None:  # a TorchServe without them
        return otf.retrieve_msg(sock)
    cmd = read_buffer(sock, 1)
    if cmd != b"I":  # a load or unknown command is not expected after the load
        raise ValueError(f"unexpected command {cmd!r} from the frontend after the model loaded")
    return cmd, read_inference(sock)


class WorkerService:
    """Replaces ts.async_service.AsyncService (same constructor and `run` contract:
    returns the error text when the connection to the frontend ends)."""

    def __init__(self, service: Any) -> None:
        self.service = service
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
        threading.Thread(target=self._read, name="inf2serve-ts-reader", daemon=True).start()
        logger.info("serving TorchServe's async protocol with inf2serve's worker service")
        return await self._ended

    def _read(self) -> None:
        """The reader thread: each request to the loop, as it arrives."""
        sock = self.service.cl_socket
        try:
            while True:
                _, batch = _receive(sock)
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
