"""A worker that takes a dead TorchServe worker's socket over, so the frontend never
restarts it.

TorchServe 0.12 restarts an async worker badly under traffic: the first request polled
after its LOAD command fails the attempt and is dropped unanswered, one request per
attempt, and the model does not come back while requests keep arriving (docs/design.md,
"A TorchServe worker that dies"). So the dead worker's guardian (handlers/engine/
guardian.py) answers the requests that worker had read, leaves the socket open with the
frontend's next message unread, and starts this process on it: TorchServe's own load
(what ts/model_service_worker.py does with the LOAD command it was sent: the same
arguments, `take_over` passes them), then the worker service on the socket, whose handler
hands it to a guardian of its own and says so on the pipe the old guardian waits on. The
frontend sees one worker that was slow for a load's time; what it sent meanwhile waits on
the socket, answered in order.

Log lines go to the dead worker's stdout, which the frontend still reads (the guardian
inherited it); the frontend still names the dead worker's pid. TorchServe's stop closes
the socket, and this process ends with it, as a worker does.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
from typing import Any

from handlers.torchserve.metrics import WORKER_ID_ENV

logger = logging.getLogger(__name__)


def main(argv: list[str]) -> None:
    """argv: the socket's fd, then the load's arguments as JSON (guardian.take_over)."""
    logging.basicConfig(stream=sys.stdout, format="%(message)s", level=logging.INFO)
    fd, load = int(argv[0]), json.loads(argv[1])
    # the dead worker's id: its metrics files and series go on, as a restarted worker's do
    os.environ[WORKER_ID_ENV] = str(load.get("worker_id") or "")
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    threading.Thread(target=_end_with_frontend, args=(sock,), name="inf2serve-takeover-watch",
                     daemon=True).start()
    error = serve(sock, load)
    logger.info("the worker that took the socket over ends: %s", error or "the frontend "
                "closed its socket")
    sys.exit(1 if error else 0)


def _end_with_frontend(sock: socket.socket) -> None:
    """The frontend closed the socket (TorchServe stopping): end now, even inside a load
    that may take minutes, as TorchServe's own worker would have been killed."""
    from handlers.engine.guardian import peer_closed

    if peer_closed(sock, None):
        logger.info("the frontend closed the socket: the worker that took it over ends")
        sys.stdout.flush()
        os._exit(0)


def serve(sock: socket.socket, load: dict[str, Any]) -> str | None:
    """TorchServe's load with `load`'s arguments, then the async service on `sock` until
    the frontend goes away; its error text."""
    from ts import async_service
    from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl
    from ts.model_loader import ModelLoaderFactory

    # the handler's initialize swaps this name for its worker service, as in
    # ts/model_service_worker.py, whose module namespace it looks in (worker_service.install)
    main_module = sys.modules["__main__"]
    main_module.AsyncService = async_service.AsyncService
    metrics = MetricsCacheYamlImpl(config_file_path=load["metrics_config"])
    metrics.initialize_cache()
    metrics.model_name = load["model_name"]
    logger.info("taking the dead worker's socket over: loading %s", load["model_name"])
    service = ModelLoaderFactory.get_model_loader().load(
        load["model_name"], load["model_dir"], load["handler"], load["gpu"],
        load["batch_size"], load["envelope"], load["limit_max_image_pixels"], metrics)
    service.set_cl_socket(sock)
    return main_module.AsyncService(service).run()
