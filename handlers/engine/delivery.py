"""Events to the requests that wait for them, from the thread that has them.

The engine's output thread (handlers/engine/core.py) and the worker's reader of the
engine process's messages (handlers/engine/client.py) both hold many requests' events at
once, for requests whose coroutines wait on one or more event loops; both hand them over
here, so that a step wakes each loop once and a broken sink costs only its own request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Protocol

from handlers.engine.scheduler import Event, Sink, TextEvent

logger = logging.getLogger(__name__)


class QueueSink:
    """A request's events onto its asyncio queue, from another thread.

    Each call wakes the event loop (a write to its self-pipe, ~18 us measured), so
    whoever holds many events at once -- a step's output, a step's message from the
    engine process -- hands them over with `deliver`: one wake-up per loop. With
    `on_text`, text goes to that callback on the loop's thread instead of the queue, so
    the request's coroutine wakes only for its end, not once per token."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Event],
                 on_text: Callable[[str], None] | None = None) -> None:
        self.loop, self.queue, self.on_text = loop, queue, on_text

    def __call__(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.put, event)

    def put(self, event: Event) -> None:
        """On the loop's thread."""
        if self.on_text is not None and type(event) is TextEvent:
            self.on_text(event.text)
        else:
            self.queue.put_nowait(event)

    @staticmethod
    def put_all(loop: asyncio.AbstractEventLoop, items: list[tuple[QueueSink, Event]],
                after: Callable[[], None] | None = None) -> None:
        """Events for sinks of `loop`, delivered in one wake-up of the loop, in order;
        then `after()`, on the loop's thread."""
        def put() -> None:
            for sink, event in items:
                try:
                    sink.put(event)
                except Exception:  # one request's failure must not cost the others theirs
                    logger.exception("delivering an event failed")
            if after is not None:
                after()

        loop.call_soon_threadsafe(put)


class Addressee(Protocol):
    """Whatever carries a request's sink: the engine's `Sequence`, the worker's entry for a
    request in the engine process (handlers/engine/client.py)."""

    request_id: str
    sink: Sink


def deliver(events: Iterable[tuple[Addressee, Event]],
            after: Callable[[], None] | None = None) -> None:
    """Events to their requests' sinks, in order; QueueSinks grouped by event loop, so a
    step wakes each loop once. `after()` runs once those events are in (on each loop's
    thread, after its events; here if no loop had any)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[QueueSink, Event]]] = {}
    for to, event in events:
        if isinstance(to.sink, QueueSink):
            by_loop.setdefault(to.sink.loop, []).append((to.sink, event))
        else:
            deliver_one(to, event)
    handed = False
    for loop, items in by_loop.items():
        try:
            QueueSink.put_all(loop, items, after)
            handed = True
        except RuntimeError:  # its loop is closed: nobody is left to read these
            logger.warning("dropped %d events for a closed event loop", len(items))
    if after is not None and not handed:
        after()


def deliver_one(to: Addressee, event: Event) -> None:
    try:
        to.sink(event)
    except Exception:  # a broken sink must not stop other requests
        logger.exception("sink of request %s failed", to.request_id)
