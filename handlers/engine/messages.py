"""The contract between the TorchServe worker and the engine: messages and one handle.

The engine runs either in the worker (handler.engine_process: inline) or in a child
process the worker supervises (child: handlers/engine/process.py,
handlers/engine/client.py). Either way the worker side sees an `EngineHandle`, hands
it an `EngineRequest` plus the sink its events go to, and never builds an engine
`Sequence` (detokenizer, stop matcher) itself: that belongs where the model runs.

Across the process boundary every message is one of the frozen dataclasses below,
pickled over one pipe and told apart by its type (`match`), never by its shape. The
shapes follow vLLM's EngineCoreRequest / EngineCoreOutputs: a request goes over once,
and one `StepOutputs` carries everything an engine step produced, so the IPC cost is per
step, not per token per sequence. A step's text events travel as plain field tuples
-- nearly every event is one, and pickling 32 frozen dataclasses and back measured
~80 us a step against ~13 us for their fields -- while the rarer last events (finish,
error) go as the objects the sinks receive.

This module imports only the event and parameter types, so both sides (and the inline
adapter in handlers/engine/start.py) can import it without importing each other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from handlers.backends.base import Capabilities, SamplingParams
from handlers.engine.scheduler import ErrorEvent, FinishEvent, Sink


@dataclass(frozen=True)
class ModelLimits:
    """The loaded backend's limits, which the worker checks requests against."""

    batch_size: int
    max_length: int
    max_prompt_length: int | None
    capabilities: Capabilities = Capabilities()  # what requests it honours


# -- worker -> engine -----------------------------------------------------------------

@dataclass(frozen=True)
class EngineRequest:
    """A validated request, as the engine needs it: ids, limits and sampling, no text.

    `arrived_at` and `deadline` are time.monotonic() values of the worker: one clock per
    host, so the engine process compares them with its own."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    arrived_at: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # after which it stops; None = never


@dataclass(frozen=True)
class Cancel:
    """Free the request's slot (or drop it from the queue); its sink gets a 499."""

    request_id: str


@dataclass(frozen=True)
class Stop:
    """Stop the engine; the engine process exits after it."""


# -- worker -> guardian (handlers/engine/guardian.py) --------------------------------

@dataclass(frozen=True)
class LastWords:
    """What the guardian writes to TorchServe for one request if the worker dies: whole
    TorchServe messages the worker encoded (the guardian knows no framing). The worker
    notes them before anything of the request can reach the frontend."""

    request_id: str
    silent: bytes  # while none of its text has gone out: its whole answer, a 500
    spoken: bytes | None  # once some text went out: an in-band error that ends the stream
    # (None: not streamed, nothing goes out before the end)


# -- engine -> worker -----------------------------------------------------------------

@dataclass(frozen=True)
class Ready:
    """The model is loaded: the first message of an engine process that could load it.
    `tokenizer`: the process's tokenizer, pickled (handlers/engine/start.pickled_tokenizer),
    for the worker to use rather than load it again; None where it does not pickle."""

    limits: ModelLimits
    tokenizer: bytes | None = None


@dataclass(frozen=True)
class LoadFailed:
    """Loading the model failed: the only message of such an engine process. `error` is the
    exception itself where it pickles (the worker raises it), `traceback` the child's."""

    error: BaseException
    traceback: str


@dataclass(frozen=True)
class Heartbeat:
    """Sent every HEARTBEAT_S from its own thread while the process serves: the worker's
    watchdog hears the process is alive (a stopped one falls silent). How long the engine
    has been in its current step is on the shared board (handlers/engine/board.py): a
    step that holds the GIL silences this thread, not the board."""


#: seconds between heartbeats
HEARTBEAT_S = 1.0
#: a process with requests that has sent nothing for this long, while it is stopped or
#: outside a step, is stopped or wedged
SILENT_S = 3.0


#: a text event's fields: (request_id, text, tokens rendered so far)
TextItem = tuple[str, str, int]
#: a request's last event: (request_id, FinishEvent or ErrorEvent)
FinalItem = tuple[str, "FinishEvent | ErrorEvent"]
#: a metric observation: (name, value, unit)
Observation = tuple[str, object, str]


@dataclass(frozen=True)
class StepOutputs:
    """Everything one engine step produced (or the answers to commands, between steps).

    Deliver `texts` before `finals`: a request's last event ends its stream, and its texts
    of the same step come before it. A request has at most one final event, after which
    it gets nothing more, so splitting the two keeps every request's order."""

    texts: list[TextItem] = field(default_factory=list)
    finals: list[FinalItem] = field(default_factory=list)
    observations: list[Observation] = field(default_factory=list)


ToEngine = EngineRequest | Cancel | Stop
FromEngine = Ready | LoadFailed | StepOutputs | Heartbeat


# -- the handle the worker side holds -------------------------------------------------

class EngineHandle(Protocol):
    """The engine as the worker side sees it, inline (handlers/engine_start.InlineEngine)
    or in the engine process (handlers/engine_client.EngineClient)."""

    @property
    def limits(self) -> ModelLimits:
        """What requests are checked against before they are submitted."""

    @property
    def down(self) -> str | None:
        """Why requests get a 503 now (the engine process is being restarted); None when
        the engine can take requests."""

    def submit(self, request: EngineRequest, sink: Sink) -> None:
        """Queue the request; its events go to `sink`, from another thread, which must not
        block. Raises CapacityError (a 503) when it cannot be queued."""

    def cancel(self, request_id: str) -> None:
        """End the request early; its sink gets ErrorEvent(499) unless it already ended."""

    def stop(self) -> None:
        """Stop the engine; requests still in flight are answered or dropped."""
