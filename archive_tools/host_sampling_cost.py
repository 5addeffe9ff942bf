"""What sampling on the host costs a Neuron model per decode step, for `validate` to print.

Without on-device sampling every decode step returns logits and the host reads all of them to
pick each row's token. The device waits meanwhile (the next step needs the token), so that
time comes off every step. The rates below are what the synthetic device measured with each
SDK's logits as they come back (bench/results/host_sampling_device.md, 2026-11-28 22:04 UTC run:
10 ms steps, 32 streams in a batch of 64, 128,256-token vocabulary, against 0.980 without
logits, on a 2-core VM about twice as fast as the one of the earlier runs there): NxD
Inference's float32 rows of the running sequences, 1.10 ms greedy and 1.55 ms sampled a step
over 32 x 128,256 logits (0.27 and 0.38 ns a logit); transformers-neuronx's logits of every
compiled line, in the model's bf16 as a transposed view whose bits the host scans
(handlers/backends/sampling/scan.py), 2.40 and 2.95 ms over 64 x 128,256 (0.29 and 0.36 ns).
Both are given for the compiled batch, the most a step hands over. With a vocabulary past 100k
that is a real share of a step at any batch worth running, which is why the ready configs of
such models sample on the device; past 5% of a 10 ms step the line is a warning.
"""

from __future__ import annotations

#: host seconds x 1e9 per logit read, (greedy, with temperature / top-k / top-p), by backend
NS_PER_LOGIT = {"nxdi": (0.27, 0.38), "neuron": (0.29, 0.36)}
REFERENCE_STEP_MS = 10.0  # the device step the share is given against
WARN_SHARE = 0.05  # of that step, sampled: past it the line is a warning
#: how the logits come back, by backend
LOGITS = {"nxdi": "float32 logits", "neuron": "logits of every compiled line"}


def host_sampling_line(batch_size: int, vocab: int, backend: str = "nxdi"
                       ) -> tuple[str, bool]:
    """(the line to print, whether it is a warning): the logits one decode step hands the host
    and the time reading them takes, with what on-device sampling gives up."""
    logits = batch_size * vocab
    greedy, sampled = (logits * rate / 1e6 for rate in NS_PER_LOGIT[backend])
    share = sampled / (REFERENCE_STEP_MS + sampled)
    of_step = f"{share:.0%}" if share >= 0.01 else "under 1%"
    line = (f"host sampling (estimate): each decode step hands the host {batch_size} x "
            f"{vocab:,} {LOGITS[backend]}: about {greedy:.2f} ms "
            f"greedy, {sampled:.2f} ms sampled, {of_step} of a {REFERENCE_STEP_MS:.0f} ms "
            "step (bench/results/host_sampling_device.md); handler.neuron.on_device_sampling: "
            "true returns token ids instead (seed, min_new_tokens, penalties, logprobs and "
            "response_format are then refused)")
    return line, share > WARN_SHARE
