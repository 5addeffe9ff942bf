"""The synthetic device: slot contract, deterministic real tokens, timing model, config.

Timing is asserted through an injected clock and sleep (the durations the backend asks
for), never by wall-clock measurement.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from handlers.backends import load_backend
from handlers.backends import sampling as sampling_pkg
from handlers.backends.base import SamplingParams, SlotError
from handlers.backends.synthetic_backend import StepTimer, SyntheticBackend
from handlers.config import parse_config
from handlers.errors import ConfigError, RequestError
from handlers.presets.synthetic_timing import PRESETS, resolve_timing
from tests.unit.fakes import one_each

GREEDY = SamplingParams()


def _config(synthetic: dict | None = None, **handler):
    h = {"backend": "synthetic", "batch_size": 4, "max_length": 256, "max_new_tokens_limit": 128,
         "synthetic": {"decode_step_ms": 10} if synthetic is None else synthetic, **handler}
    return parse_config({"handler": h}).handler


class FakeClock:
    """perf_counter that only moves when asked; sleep records what was requested."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []
        self.work_s = 0.0  # host time each clock read after the first of a call adds

    def clock(self) -> float:
        t = self.now
        self.now += self.work_s
        return t

    def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 9))
        self.now += seconds


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint)


def _backend(ckpt: Path, tok, clock: FakeClock | None = None, **kw) -> SyntheticBackend:
    clock = clock or FakeClock()
    return SyntheticBackend(ckpt, _config(**kw), tokenizer=tok, clock=clock.clock,
                            sleep=clock.sleep)


def _run(backend: SyntheticBackend, slot: int, prompt: list[int], n: int,
         params: SamplingParams = GREEDY) -> list[int]:
    out = backend.prefill([slot], [prompt], [params])
    for _ in range(n - 1):
        out += one_each(backend.decode([slot]))
    backend.release([slot])
    return out


# -- contract ------------------------------------------------------------------------------
def test_prefill_into_busy_slot_raises(tiny_checkpoint, tokenizer):
    b = _backend(tiny_checkpoint, tokenizer)
    b.prefill([1], [[5, 6]], [GREEDY])
    with pytest.raises(SlotError, match="busy slots \\[1\\]"):
        b.prefill([0, 1], [[5], [6]], [GREEDY, GREEDY])
    assert one_each(b.decode([1]))  # the failed prefill left the running batch as it was


def test_decode_must_name_exactly_the_running_slots(tiny_checkpoint, tokenizer):
    b = _backend(tiny_checkpoint, tokenizer)
    b.prefill([0, 2], [[5], [6]], [GREEDY, GREEDY])
    for wrong in ([0], [0, 1, 2], [0, 0, 2]):
        with pytest.raises(SlotError, match="running \\[0, 2\\]"):
            one_each(b.decode(wrong))
    b.release([0])
    assert len(one_each(b.decode([2]))) == 1


def test_slots_and_prompt_lengths_are_checked(tiny_checkpoint, tokenizer):
    b = _backend(tiny_checkpoint, tokenizer)
    with pytest.raises(SlotError, match="distinct slots in \\[0, 4\\)"):
        b.prefill([4], [[5]], [GREEDY])
    with pytest.raises(RequestError, match="prompt"):
        b.prefill([0], [[]], [GREEDY])
    with pytest.raises(RequestError, match="expected 1 to 255"):
        b.prefill([0], [[5] * 256], [GREEDY])


def test_load_backend_builds_it_from_the_config(tiny_checkpoint):
    cfg = _config(checkpoint=tiny_checkpoint.name)
    backend = load_backend(cfg, tiny_checkpoint.parent)
    assert isinstance(backend, SyntheticBackend)
    assert (backend.batch_size, backend.max_length, backend.max_prompt_length) == (4, 256, 255)


def test_batch_of_64_slots(tiny_checkpoint, tokenizer):
    b = _backend(tiny_checkpoint, tokenizer, batch_size=64)
    b.prefill(list(range(64)), [[i + 1] for i in range(64)], [GREEDY] * 64)
    assert len(one_each(b.decode(list(range(64))))) == 64


# -- tokens ------------------------------------------------------------------------------
def test_tokens_are_plain_words_never_special_or_eos(tiny_checkpoint, tokenizer):
    b = _backend(tiny_checkpoint, tokenizer)
    out = _run(b, 0, tokenizer("Once upon a time")["input_ids"], 64)
    assert not set(out) & (set(tokenizer.all_special_ids) | b.eos_token_ids)
    text = tokenizer.decode(out)
    assert text.startswith(" ") and all(w.isalpha() for w in text.split())
    assert len(text.split()) == 64  # every token starts a word


def test_greedy_is_a_function_of_prompt_and_position(tiny_checkpoint, tokenizer):
    alone = _run(_backend(tiny_checkpoint, tokenizer), 0, [5, 6, 7], 12)
    b = _backend(tiny_checkpoint, tokenizer)
    b.prefill([3], [[9, 9]], [GREEDY])  # another row running, in another slot
    one_each(b.decode([3]))
    got = b.prefill([1], [[5, 6, 7]], [GREEDY])
    for _ in range(11):
        got += one_each(b.decode([3, 1]))[1:]
    assert got == alone
    assert _run(_backend(tiny_checkpoint, tokenizer), 0, [5, 6, 8], 12) != alone


def test_sampling_follows_the_seed(tiny_checkpoint, tokenizer):
    b = _backend(tiny_checkpoint, tokenizer)
    seeded = SamplingParams(temperature=0.8, seed=7)
    first = _run(b, 0, [5, 6], 16, seeded)
    assert _run(b, 0, [5, 6], 16, seeded) == first
    assert _run(b, 0, [5, 6], 16, SamplingParams(temperature=0.8, seed=8)) != first
    assert _run(b, 0, [5, 6], 16) != first  # greedy is another sequence


# -- timing ------------------------------------------------------------------------------
def test_decode_sleeps_the_step_of_the_compiled_batch(tiny_checkpoint, tokenizer):
    clock = FakeClock()
    b = _backend(tiny_checkpoint, tokenizer, clock,
                 synthetic={"decode_step_ms": 5, "decode_ms_per_row": 0.5})
    b.prefill([0], [[5]], [GREEDY])
    clock.slept.clear()
    one_each(b.decode([0]))  # one live row in a compiled batch of 4: the whole batch's step
    assert clock.slept == [pytest.approx(0.0065)]


def test_sleep_ends_at_a_deadline_from_the_call_start(tiny_checkpoint, tokenizer):
    clock = FakeClock()
    b = _backend(tiny_checkpoint, tokenizer, clock, synthetic={"decode_step_ms": 10})
    b.prefill([0], [[5]], [GREEDY])
    clock.slept.clear()
    clock.work_s = 0.002  # host work inside the call is hidden behind the device time
    one_each(b.decode([0]))
    assert clock.slept == [pytest.approx(0.008)]
    clock.work_s = 0.02  # work longer than the step: no sleep at all
    one_each(b.decode([0]))
    assert clock.slept == [pytest.approx(0.008)]


def test_a_step_ends_at_its_deadline_when_sleeps_wake_late(tiny_checkpoint, tokenizer):
    """Sleeps that wake 0.1 ms late: the timer learns to sleep that much less and polls
    the rest, so steps end on their deadline instead of 0.1 ms after it -- never before."""
    clock = FakeClock()
    late, asked = 0.0001, []

    def sleep(seconds: float) -> None:
        asked.append(seconds)
        clock.sleep(seconds + late)

    def poll() -> None:
        clock.now += 0.000001

    timer = StepTimer(clock.clock, sleep, poll)
    ends = []
    for _ in range(StepTimer.LEAD_WINDOW + 5):
        deadline = clock.now + 0.01
        timer.wait_until(deadline)
        ends.append(clock.now - deadline)
    assert ends[0] == pytest.approx(late)  # before it has learned
    assert timer.lead == pytest.approx(late)
    assert all(0 <= e < 2e-6 for e in ends[StepTimer.LEAD_WINDOW:])
    assert asked[-1] == pytest.approx(0.01 - late, abs=1e-9)


def test_a_sleep_that_wakes_early_is_followed_by_polling_to_the_deadline():
    clock = FakeClock()
    polls = []

    def poll() -> None:
        polls.append(clock.now)
        clock.now += 0.0001

    timer = StepTimer(clock.clock, lambda s: clock.sleep(s - 0.0005), poll)
    deadline = clock.now + 0.01
    timer.wait_until(deadline)
    assert clock.now >= deadline and len(polls) == 5
    assert timer.lead == 0.0  # an early wake-up never makes it sleep longer


def test_polling_takes_at_most_a_quarter_of_a_short_wait():
    """Sleeps that wake 2 ms late (a busy host) push the lead to its 1 ms cap; a 2 ms wait
    still sleeps 1.5 ms of it, so a short step keeps the CPU for 0.5 ms, not half of it."""
    clock = FakeClock()
    asked = []

    def sleep(seconds: float) -> None:
        asked.append(seconds)
        clock.sleep(seconds + 0.002)

    timer = StepTimer(clock.clock, sleep, lambda: None)
    for _ in range(StepTimer.LEAD_WINDOW):
        timer.wait_until(clock.now + 0.01)
    assert timer.lead == StepTimer.LEAD_MAX_S
    timer.wait_until(clock.now + 0.01)
    assert asked[-1] == pytest.approx(0.01 - StepTimer.LEAD_MAX_S)
    timer.wait_until(clock.now + 0.002)
    assert asked[-1] == pytest.approx(0.002 * (1 - StepTimer.POLL_SHARE_MAX))


@pytest.mark.parametrize("batching,joined_s", [("continuous", 0.006), ("micro", 0.004)])
def test_prefill_costs_each_prompts_bucket_or_a_micro_batchs_longest(tiny_checkpoint, tokenizer,
                                                                      batching, joined_s):
    """Continuous batching: the SDKs encode one sequence per context call, so two newcomers
    in one prefill cost both their buckets (2 + 4 ms); a micro-batch is one call (4 ms)."""
    clock = FakeClock()
    b = _backend(tiny_checkpoint, tokenizer, clock, batching=batching, synthetic={
        "decode_step_ms": 5, "context_length_estimate": [16, 64, 128], "prefill_ms": [2, 4, 8]})
    b.prefill([0, 1], [[5] * 10, [6] * 17], [GREEDY, GREEDY])
    b.prefill([2], [[7] * 16], [GREEDY])
    assert clock.slept == [pytest.approx(joined_s), pytest.approx(0.002)]
    assert b.max_prompt_length == 128
    with pytest.raises(RequestError, match="expected 1 to 128"):
        b.prefill([3], [[5] * 129], [GREEDY])


def test_preset_interpolates_published_figures_and_keys_override_it():
    cfg = _config({"preset": "llama-2-7b-tp24"}, max_length=1024)
    t = resolve_timing(cfg.synthetic, cfg.max_length)
    assert t.decode_s(1) == pytest.approx(0.0065)
    assert t.decode_s(8) == pytest.approx(0.0121)  # the published batch-8 figure
    assert t.buckets == (128, 512, 1024)  # buckets past max_length dropped
    assert t.prefill_ms == PRESETS["llama-2-7b-tp24"].prefill_ms[:3]
    cfg = _config({"preset": "llama-2-13b-tp24", "decode_ms_per_row": 0,
                   "context_length_estimate": [256]}, max_length=1024)
    t = resolve_timing(cfg.synthetic, cfg.max_length)
    assert (t.decode_s(8), t.buckets) == (pytest.approx(0.0092), (256,))
    assert t.prefill_ms == (PRESETS["llama-2-13b-tp24"].prefill_ms[1],)  # its 512 bucket


def test_without_a_preset_defaults_are_one_bucket_at_one_step():
    cfg = _config({"decode_step_ms": 10})
    t = resolve_timing(cfg.synthetic, cfg.max_length)
    assert (t.decode_s(64), t.buckets, t.prefill_ms) == (pytest.approx(0.01), (256,), (10.0,))


# -- config errors -----------------------------------------------------------------------
@pytest.mark.parametrize("synthetic, message", [
    ({}, "handler.synthetic.decode_step_ms: required"),
    ({"preset": "llama-2-70b"}, "handler.synthetic.preset: 'llama-2-70b' is not allowed"),
    ({"decode_step_ms": -1}, "handler.synthetic.decode_step_ms: -1 is out of range"),
    ({"decode_step_ms": "fast"}, "handler.synthetic.decode_step_ms: expected float"),
    ({"decode_step_ms": 5, "prefill_ms": [1, 2]}, "handler.synthetic.prefill_ms: \\[1, 2\\]; "
                                                  "expected 1 number"),
    ({"decode_step_ms": 5, "context_length_estimate": [64, 32]},
     "handler.synthetic.context_length_estimate: \\[64, 32\\]; expected ascending"),
    ({"decode_step_ms": 5, "context_length_estimate": [512]}, "handler.max_length 256"),
    ({"step_ms": 5}, "handler.synthetic.step_ms: unknown key"),
])
def test_config_errors_name_the_key(synthetic, message):
    with pytest.raises(ConfigError, match=message):
        _config(synthetic)


def test_synthetic_section_is_ignored_by_other_backends():
    assert parse_config({"handler": {"backend": "torch", "synthetic": {}}}).handler.backend == \
        "torch"


def test_null_keys_mean_unset():
    cfg = _config({"preset": "llama-2-7b-tp24", "decode_step_ms": None})
    assert resolve_timing(cfg.synthetic, 256).decode_step_ms == 6.5


def test_timer_slack_of_the_calling_thread_is_tightened():
    import sys
    import threading

    from handlers.backends.synthetic_backend import tighten_timer_slack

    if not sys.platform.startswith("linux"):
        pytest.skip("prctl(PR_SET_TIMERSLACK) is Linux only")
    seen = {}

    def probe():  # a fresh thread, so the test process's own slack is left alone
        import ctypes

        seen["ok"] = tighten_timer_slack()
        seen["slack"] = ctypes.CDLL(None).prctl(30, 0, 0, 0, 0)  # PR_GET_TIMERSLACK, this thread

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    assert seen == {"ok": True, "slack": 1000}


def test_the_shipped_synthetic_config_validates(capsys):
    from archive_tools.cli import main
    from handlers.config import load_config

    path = Path(__file__).resolve().parents[2] / "model_configs" / "synthetic-llama-2-7b.yaml"
    h = load_config(path).handler
    assert h.backend == "synthetic" and h.synthetic.preset == "llama-2-7b-tp24"
    assert resolve_timing(h.synthetic, h.max_length).decode_s(h.batch_size) == \
        pytest.approx(0.0121)
    assert main(["validate", str(path)]) == 0
    assert "backend synthetic: no Neuron checks" in capsys.readouterr().out


# -- host sampling -----------------------------------------------------------------------
HOST_VOCAB = 4096  # above the tiny checkpoint's 1,024 ids; blocks and a remainder


def _host(ckpt: Path, tok, clock: FakeClock | None = None, vocab: int = HOST_VOCAB,
          layout: str = "nxdi", floor: bool = False, **kw) -> SyntheticBackend:
    return _backend(ckpt, tok, clock, synthetic={"decode_step_ms": 10,
                                                 "host_sampling_vocab": vocab,
                                                 "host_sampling_logits": layout,
                                                 "host_sampling_floor": floor}, **kw)


@pytest.mark.parametrize("params", [
    GREEDY, SamplingParams(temperature=0.8, top_p=0.95, seed=3),
    SamplingParams(temperature=100.0, top_k=2, seed=4), SamplingParams(min_new_tokens=4),
    SamplingParams(temperature=1e-4, top_p=0.5, seed=5)])
@pytest.mark.parametrize("layout", ["nxdi", "neuron"])
def test_host_sampling_keeps_the_synthetic_tokens(tiny_checkpoint, tokenizer, params, layout):
    prompt = [5, 6, 7]
    want = _run(_backend(tiny_checkpoint, tokenizer), 0, prompt, 12, params)
    host = _host(tiny_checkpoint, tokenizer, layout=layout)
    before = host._host.logits.clone()
    assert _run(host, 0, prompt, 12, params) == want
    # each call puts back the logit the one before raised: only the last call's is up
    assert int((host._host.logits != before).sum()) == 1
    host._host._restore()
    assert torch.equal(host._host.logits, before)


@pytest.mark.parametrize("layout", ["nxdi", "neuron"])
def test_the_host_sampling_floor_reads_the_logits_and_samples_nothing(
        tiny_checkpoint, tokenizer, layout, monkeypatch):
    """host_sampling_floor: the bench's floor cell reads the logits once per call, keeps the
    synthetic tokens and never calls the sampler."""
    from handlers.backends import sampling

    def no_sampler(*a, **k):
        raise AssertionError("the floor sampled")

    prompt = [5, 6, 7]
    want = _run(_backend(tiny_checkpoint, tokenizer), 0, prompt, 12)
    host = _host(tiny_checkpoint, tokenizer, layout=layout, floor=True)
    monkeypatch.setattr(sampling, "sample_rows", no_sampler)
    reads = []
    read = host._host._read
    host._host._read = lambda n: (reads.append(n), read(n))[1]
    assert _run(host, 0, prompt, 12) == want
    assert reads == [1] * 12  # the prefill's call and 11 decodes, one row each


def test_host_sampling_of_unseeded_rows_in_a_full_batch(tiny_checkpoint, tokenizer):
    """Unseeded rows take the batched path; what they pick is the synthetic model's own
    random word (pick() raises otherwise), alongside greedy rows, at temperatures from
    near-greedy (the raised logit / T is ~1e10) to the largest a request may ask."""
    b = _host(tiny_checkpoint, tokenizer, batch_size=8)
    params = [SamplingParams(temperature=0.8, top_p=0.95), GREEDY,
              SamplingParams(temperature=1e-4, top_p=0.9),
              SamplingParams(temperature=100.0, top_k=3)] * 2
    out = b.prefill(list(range(8)), [[i + 1] for i in range(8)], params)
    for _ in range(5):
        out += one_each(b.decode(list(range(8))))
    assert set(out) <= set(b.words)


def test_neuron_host_logits_are_transformers_neuronx_s(tiny_checkpoint, tokenizer, monkeypatch):
    """layout "neuron": the device's bf16 [vocab, 1, rows], viewed transposed (bf16, as
    cast_logits_dtype bf16 leaves it), its first m rows for slots below m
    (free lines sampled and dropped, as the neuron backend does); every row gets the
    tokens it gets without host sampling, whatever order the slots are named in."""
    host = _host(tiny_checkpoint, tokenizer, layout="neuron", batch_size=8)
    assert host._host.logits.dtype == torch.bfloat16
    assert host._host.logits.shape == (HOST_VOCAB, 1, 8)
    seen = []
    real = sampling_pkg.sample_rows

    def spy(logits, samplers, *args, **kw):
        seen.append((logits.dtype, logits.stride(), len(samplers)))
        return real(logits, samplers, *args, **kw)

    monkeypatch.setattr(sampling_pkg, "sample_rows", spy)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=1), GREEDY,
              SamplingParams(temperature=100.0, top_k=3, seed=2), GREEDY]
    outs = []
    for b in (_backend(tiny_checkpoint, tokenizer, batch_size=8), host):
        out = [b.prefill([5, 1, 6, 3], [[i + 1] for i in range(4)], params)]
        out += [b.decode([5, 1, 6, 3]) for _ in range(3)]
        b.release([5, 6])
        out += [b.prefill([0, 2], [[9], [10]], [GREEDY] * 2)]
        out += [b.decode([3, 2, 1, 0]) for _ in range(2)]
        outs.append(out)
    assert outs[1] == outs[0]
    assert seen[1] == (torch.bfloat16, (1, 8), 7)  # slots 1, 3, 5, 6: lines 0..6
    assert seen[-1] == (torch.bfloat16, (1, 8), 4)  # slots 0..3


def test_host_sampling_runs_after_the_device_step(tiny_checkpoint, tokenizer, monkeypatch):
    """On Neuron the host samples the logits a call returned, before the next call can
    start: its time lengthens the step instead of hiding inside it. The logits themselves
    are the device's work: made within the call's time, before its deadline."""
    from handlers.backends import synthetic_backend

    clock = FakeClock()
    events = []
    b = _host(tiny_checkpoint, tokenizer, clock)
    sleep, pick = clock.sleep, synthetic_backend.HostSampling.pick
    emit = synthetic_backend.HostSampling.emit

    def timed_emit(self, tokens, lines=None):
        events.append("logits")
        emit(self, tokens, lines)

    def timed_sleep(seconds):
        events.append("device")
        sleep(seconds)

    def timed_pick(self, samplers, tokens, masks=None, lines=None):
        events.append("host")
        clock.now += 0.003  # host sampling's time
        return pick(self, samplers, tokens, masks, lines)

    b._timer._sleep = timed_sleep
    monkeypatch.setattr(synthetic_backend.HostSampling, "pick", timed_pick)
    monkeypatch.setattr(synthetic_backend.HostSampling, "emit", timed_emit)
    start = clock.now
    b.prefill([0], [[5]], [GREEDY])
    one_each(b.decode([0]))
    assert events == ["logits", "device", "host", "logits", "device", "host"]
    assert clock.now - start == pytest.approx(0.010 + 0.003 + 0.010 + 0.003)


def test_host_sampling_vocab_must_hold_the_word_tokens(tiny_checkpoint, tokenizer):
    with pytest.raises(ConfigError, match="host_sampling_vocab: 100 cannot hold the "
                                          "checkpoint's word tokens"):
        _host(tiny_checkpoint, tokenizer, vocab=100)
    assert _backend(tiny_checkpoint, tokenizer)._host is None  # off by default


# -- speculation ---------------------------------------------------------------------------
SPEC = {"decode_step_ms": 10, "speculation_length": 4, "draft_step_ms": 1,
        "acceptance_rate": 0.7}


def _speculate(backend: SyntheticBackend, slot: int, prompt: list[int], calls: int,
               params: SamplingParams = GREEDY) -> list[list[int]]:
    rows = [backend.prefill([slot], [prompt], [params])]
    rows += [backend.decode([slot])[0] for _ in range(calls)]
    backend.release([slot])
    return rows


def test_speculation_yields_the_same_tokens_a_step_of_one_would(tiny_checkpoint, tokenizer):
    """Lossless: the accepted tokens, joined, are the plain device's tokens; each decode
    keeps 1 to k + 1 of them, and the pattern repeats for the same prompt (and seed)."""
    spec = _backend(tiny_checkpoint, tokenizer, synthetic=SPEC)
    assert spec.max_tokens_per_step == 5
    for params in (GREEDY, SamplingParams(temperature=0.9, seed=7)):
        rows = _speculate(spec, 0, [5, 6], 40, params)
        assert all(1 <= len(r) <= 5 for r in rows[1:]) and len({len(r) for r in rows}) > 2
        flat = [t for r in rows for t in r]
        plain = _backend(tiny_checkpoint, tokenizer)
        assert flat == _run(plain, 0, [5, 6], len(flat), params)
        assert _speculate(spec, 2, [5, 6], 40, params) == rows


def test_speculation_accepts_at_the_configured_rate_and_costs_k_drafts_and_one_target(
        tiny_checkpoint, tokenizer):
    clock = FakeClock()
    spec = _backend(tiny_checkpoint, tokenizer, clock, synthetic=SPEC)
    assert spec.timing.tokens_per_call() == pytest.approx((1 - 0.7 ** 5) / 0.3)
    rows = _speculate(spec, 0, [9], 2000)[1:]
    mean = sum(map(len, rows)) / len(rows)
    assert mean == pytest.approx(spec.timing.tokens_per_call(), rel=0.05)
    clock.slept.clear()
    spec.prefill([0], [[5]], [GREEDY])
    clock.slept.clear()
    spec.decode([0])
    assert clock.slept == [pytest.approx(0.014)]  # 4 drafts x 1 ms + the 10 ms target step


def test_speculation_settings_are_checked_and_default_the_draft_step(tiny_checkpoint,
                                                                     tokenizer):
    t = resolve_timing(_config({"decode_step_ms": 8, "speculation_length": 3}).synthetic, 256)
    assert (t.speculation_length, t.draft_step_ms, t.acceptance_rate) == (3, 0.8, 0.7)
    with pytest.raises(ConfigError, match=r"acceptance_rate: 1.5 is out of range"):
        _config({"decode_step_ms": 8, "speculation_length": 3, "acceptance_rate": 1.5})
    with pytest.raises(ConfigError, match="host sampling with speculation_length"):
        _backend(tiny_checkpoint, tokenizer,
                 synthetic={**SPEC, "host_sampling_vocab": 200_000})


@pytest.mark.parametrize("layout", ["nxdi", "neuron"])
def test_host_pick_follows_masks_in_the_callers_row_order(layout):
    """A constrained row keeps its mask when the neuron layout reorders the rows by slot:
    a mask allowing only the synthetic token, and one that does not allow the row's best
    other token, on rows whose slots run backwards."""
    import numpy as np

    from handlers.backends.synthetic_logits import HostSampling
    from handlers.structured.masks import StepMasks

    host = HostSampling(4, HOST_VOCAB, frozenset([2]), layout=layout)
    tokens, lines = [100, 200, 300, 400], [3, 2, 1, 0]
    bitmask = np.zeros((2, HOST_VOCAB // 32), dtype=np.int32)
    for k, token in enumerate((200, 400)):
        bitmask[k, token // 32] |= np.int32(1 << (token % 32))
    masks = StepMasks(np.array([1, 3]), bitmask)
    samplers = [host.sampler(p, [1]) for p in (GREEDY, GREEDY, SamplingParams(temperature=0.9),
                                                 SamplingParams(temperature=0.9, top_k=5))]
    assert host.pick(samplers, tokens, masks, lines) == tokens
