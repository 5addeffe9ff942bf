"""The contract between the scheduler and a model runtime.

A backend owns `batch_size` slots (the compiled batch on Neuron) and runs the
model on them; it never decides who runs. The engine calls, from one thread (the slot
rules -- prefill into free, distinct slots; decode every running slot -- are checked
here, once, around each backend's own `_prefill`/`_decode`/`_release`/`_step`):

    prefill(slots, prompts, params) -> first token of each new sequence
    decode(slots)                   -> the next tokens of every running sequence, a list
                                       per row: one, or up to `max_tokens_per_step` where
                                       a step accepts several (speculative decoding)
    release(slots)                  -> forget finished sequences

and, where `mixes_prefill` is true, `step(slots, prompts, params, running)`: the
prefill and the running batch's decode in one model call. A row's tokens may run past
its end (EOS, a length limit): the engine keeps them up to the first that ends it
(`Sequence.extend`), so a backend never needs to know a request's limits.

Token ids cross this boundary as plain ints so the scheduler stays free of torch.
Sampling (greedy, temperature, top-k, top-p, per-request seed, min_new_tokens)
happens inside the backend, next to the logits, and so does a grammar's mask
(structured outputs): a backend that samples on the host has `grammars` (a
handlers/structured SlotGrammars over its logits' width), `prefill` and `step` take
each newcomer's compiled grammar (None: a free row) and hand it to that, and the
backend fills and applies the masks around its device calls. A backend without it
refuses such requests (Capabilities.unsupported["grammar"]).
"""

from __future__ import annotations

import importlib
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from handlers.errors import GenerationError
from handlers.structured.spec import GrammarSpec

GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # below GREEDY_BELOW = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    min_new_tokens: int = 0  # EOS is suppressed until this many tokens were generated
    ignore_eos: bool = False  # EOS does not end the sequence (benchmarks: exactly max tokens)
    # penalties as vLLM applies them, before temperature: repetition divides a positive
    # logit (multiplies a negative one) of any token in prompt or output; frequency and
    # presence subtract count * f + (count > 0) * p for tokens of the output
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None  # None: none; k: each generated token's + the top k
    prompt_logprobs: int | None = None  # the same for every prompt token (OpenAI `echo`)
    #: structured outputs: the shape the answer must take (a JSON schema, any JSON object,
    #: forced tool calls), compiled by the engine before the request is admitted
    grammar: GrammarSpec | None = None

    @property
    def greedy(self) -> bool:
        # dividing logits by a near-zero temperature overflows; it means argmax anyway
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)


#: the request features a backend may lack, by their SamplingParams name
FEATURES = ("seed", "min_new_tokens", "ignore_eos", "repetition_penalty", "frequency_penalty",
            "presence_penalty", "logprobs", "prompt_logprobs", "grammar")


@dataclass(frozen=True)
class Capabilities:
    """`unsupported` maps a feature (FEATURES) to why this backend cannot honour it, the
    reason naming the setting that decides and the way out. `max_top_k` bounds top_k where
    the device keeps only so many candidates. `shared_sampling`: one device call samples
    every row with one parameter set (transformers-neuronx's `sample()`), so the scheduler
    puts only requests with the same `sampling_group` in one micro-batch."""

    unsupported: Mapping[str, str] = field(default_factory=dict)
    max_top_k: int | None = None
    max_top_k_setting: str = ""
    shared_sampling: bool = False

    def __post_init__(self) -> None:
        unknown = sorted(set(self.unsupported) - set(FEATURES))
        if unknown:
            raise ValueError(f"unknown capability features {unknown}; known: {FEATURES}")
        # read-only and picklable as a plain dict (it crosses the engine-process pipe)
        object.__setattr__(self, "unsupported", MappingProxyType(dict(self.unsupported)))

    def __reduce__(self):
        return (Capabilities, (dict(self.unsupported), self.max_top_k, self.max_top_k_setting,
                               self.shared_sampling))

    @classmethod
    def lacking(cls, features: tuple[str, ...], why: str, **kwargs) -> Capabilities:
        """Every one of `features` refused for the same reason."""
        return cls({f: why for f in features}, **kwargs)


#: one token's log-probability under the model (raw logits, before any sampling
#: parameter) and the top alternatives: (logprob, ((token id, logprob), ...))
TokenLogprob = tuple[float, tuple[tuple[int, float], ...]]
#: a decode's output: each row's new tokens, in the order of the slots asked for
Rows = list[list[int]]


class SlotError(GenerationError):
    """The engine broke the slot contract: a bug upstream, failing that call only."""


class Backend(ABC):
    """Runs a causal LM on a fixed number of slots."""

    #: sequences that can run at once (slot ids are 0..batch_size-1)
    batch_size: int
    #: positions per sequence: prompt + generated tokens
    max_length: int
    #: longest prompt a prefill accepts (Neuron: the largest compiled bucket)
    max_prompt_length: int
    #: token ids that end a sequence
    eos_token_ids: frozenset[int]
    #: whether `step` can run newcomers' prefill together with the running batch's decode
    mixes_prefill: bool = False
    #: the most tokens one decode yields per row (> 1: speculation); the engine's
    #: arithmetic of which decodes can end a sequence by length reads it
    max_tokens_per_step: int = 1
    #: what requests it honours (default: host sampling from full logits, everything)
    capabilities: Capabilities = Capabilities()
    #: the grammars of its constrained slots and their masks (handlers.structured.masks.
    #: SlotGrammars over the logits' width): set by a backend that samples on the host
    grammars: Any = None

    # -- the contract, enforced here once; backends implement the underscored methods ---
    def prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]],
                params: Sequence[SamplingParams], grammars: Sequence[Any] | None = None
                ) -> list[int]:
        """Start a sequence in each (free) slot; return each one's first generated token.
        `grammars`: each newcomer's RowGrammar (handlers.structured.masks), None for a free
        one; the first token already keeps to it."""
        self._check_new(slots, prompts, params)
        self._assign(slots, grammars)
        try:
            tokens = self._prefill(list(slots), list(prompts), list(params))
        except BaseException:
            self._unassign(slots)
            raise
        self._busy().update(slots)  # only once it ran: a failed prefill took no slot
        return tokens

    def decode(self, slots: Sequence[int]) -> Rows:
        """One step for the running sequences in `slots` (all of them); each one's new
        tokens (at least one, at most `max_tokens_per_step`)."""
        self._check_running(slots)
        return self._decode(list(slots))

    def release(self, slots: Sequence[int]) -> None:
        """Free the slots of finished or failed sequences (a free slot is ignored)."""
        try:
            self._release(list(slots))
        finally:
            self._busy().difference_update(slots)
            self._unassign(slots)

    def step(self, slots: Sequence[int], prompts: Sequence[Sequence[int]],
             params: Sequence[SamplingParams], running: Sequence[int],
             grammars: Sequence[Any] | None = None) -> tuple[list[int], Rows]:
        """`prefill(slots, ...)` and `decode(running)` as one call, for backends where that
        is cheaper (`mixes_prefill`). On failure the running batch must be as it was."""
        if not self.mixes_prefill:
            raise NotImplementedError(f"{type(self).__name__} does not mix prefill into decode")
        self._check_new(slots, prompts, params)
        self._check_running(running)
        self._assign(slots, grammars)
        try:
            first, following = self._step(list(slots), list(prompts), list(params),
                                          list(running))
        except BaseException:
            self._unassign(slots)
            raise
        self._busy().update(slots)
        return first, following

    def _assign(self, slots: Sequence[int], grammars: Sequence[Any] | None) -> None:
        if grammars is None or all(g is None for g in grammars):
            return
        if len(grammars) != len(slots):
            raise SlotError(f"{len(grammars)} grammars for {len(slots)} slots")
        if self.grammars is None:
            raise SlotError(f"{type(self).__name__} applies no grammar; its capabilities "
                            "refuse such requests")
        self.grammars.assign(slots, grammars)

    def _unassign(self, slots: Sequence[int]) -> None:
        if self.grammars is not None:
            self.grammars.drop(slots)

    @abstractmethod
    def _prefill(self, slots: list[int], prompts: list[Sequence[int]],
                 params: list[SamplingParams]) -> list[int]:
        """`prefill` for free, distinct, in-range slots."""

    @abstractmethod
    def _decode(self, slots: list[int]) -> Rows:
        """`decode` of exactly the running slots."""

    @abstractmethod
    def _release(self, slots: list[int]) -> None:
        """`release`; must ignore a slot that is not running."""

    def _step(self, slots: list[int], prompts: list[Sequence[int]],
              params: list[SamplingParams], running: list[int]
              ) -> tuple[list[int], Rows]:
        raise NotImplementedError(f"{type(self).__name__} does not mix prefill into decode")

    def _busy(self) -> set[int]:
        """The running slots (the base class's, whatever the subclass's __init__ did)."""
        busy = self.__dict__.get("_slots_busy")
        if busy is None:
            busy = self.__dict__["_slots_busy"] = set()
        return busy

    def _check_new(self, slots: Sequence[int], prompts: Sequence[Sequence[int]],
                   params: Sequence[SamplingParams]) -> None:
        if not len(slots) == len(prompts) == len(params):
            raise SlotError(f"prefill of {len(slots)} slots, {len(prompts)} prompts and "
                            f"{len(params)} sampling params")
        if len(set(slots)) != len(slots) or not all(0 <= s < self.batch_size for s in slots):
            raise SlotError(f"prefill slots {list(slots)}: expected distinct slots in "
                            f"[0, {self.batch_size})")
        busy = sorted(self._busy() & set(slots))
        if busy:
            raise SlotError(f"prefill into busy slots {busy}; release them first")

    def _check_running(self, slots: Sequence[int]) -> None:
        busy = self._busy()
        if len(set(slots)) != len(slots) or set(slots) != busy:
            raise SlotError(f"decode of slots {sorted(slots)} but running {sorted(busy)}: a "
                            "decode covers every running slot, once")

    def token_logprobs(self, slot: int) -> TokenLogprob | None:
        """The last token of `slot`'s logprob, for a sequence whose `SamplingParams.logprobs`
        is set (backends that sample on the host, one token per step; the others refuse
        such requests)."""
        return None

    def prompt_logprobs(self, slot: int) -> list[TokenLogprob | None] | None:
        """After prefill, per prompt token (None for the first), for a sequence whose
        `SamplingParams.prompt_logprobs` is set; taken once."""
        return None

    def warmup(self) -> None:  # noqa: B027 - optional hook
        """Run representative shapes once so the first request does not pay for them."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release devices and locks."""

    def grammar_vocab(self) -> int | None:
        """The width of the logits a grammar's masks cover (None: no grammar here)."""
        return None if self.grammars is None else self.grammars.vocab_size


def read_eos_ids(checkpoint: Path, model_config: dict[str, Any]) -> frozenset[int]:
    """EOS ids from generation_config.json (what generate uses), else config.json."""
    eos = None
    gen = checkpoint / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
    if eos is None:
        eos = model_config.get("eos_token_id")
    return frozenset([eos] if isinstance(eos, int) else (eos or []))


def import_sdk_class(package: str, name: str, *, sdk: tuple[str, ...], backend: str,
                     key: str, example: str, install: str) -> type:
    """`package`.`name` ("module.Class") from a Neuron SDK library: a missing SDK package
    (one of `sdk`) -> NeuronUnavailableError with the install hint; a bad name ->
    ConfigError naming the config `key`."""
    from handlers.errors import ConfigError, NeuronUnavailableError

    try:
        importlib.import_module(package)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in sdk:
            raise NeuronUnavailableError(f"handler.backend is {backend} but {exc.name} is not "
                                         f"installed; {install}") from exc
        raise
    module_name, _, cls_name = name.rpartition(".")
    try:
        return getattr(importlib.import_module(f"{package}.{module_name}"), cls_name)
    except (ModuleNotFoundError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{key}: {name!r} is not a class of {package}; expected {example}"
                          ) from exc
