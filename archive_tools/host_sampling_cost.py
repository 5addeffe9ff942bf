"""What sampling on the host costs a Neuron model per decode step, for `validate` to print.

Without on-device sampling every decode step returns float32 logits [batch, vocabulary] and
the host reads all of them to pick each row's token. The device waits meanwhile (the next step
needs the token), so that time comes off every step. The rates below are what the synthetic
device measured on the bench host (bench/results/host_sampling_device.md: 32 rows of 128,256
logits after 10 ms steps kept 0.791 of the device's tokens greedy and 0.742 sampled, against
0.960 without logits): about 2.2 ms and 3.1 ms a step, i.e. 0.54 and 0.75 ns a logit. With a
vocabulary past 100k that is a real share of a step at any batch worth running, which is why the
ready configs of such models sample on the device; past 5% of a 10 ms step the line is a warning.
"""

from __future__ import annotations

GREEDY_NS_PER_LOGIT = 0.54  # host seconds x 1e9 per float32 logit read, greedy
SAMPLED_NS_PER_LOGIT = 0.75  # with temperature / top-k / top-p
REFERENCE_STEP_MS = 10.0  # the device step the share is given against
WARN_SHARE = 0.05  # of that step, sampled: past it the line is a warning


def host_sampling_line(batch_size: int, vocab: int) -> tuple[str, bool]:
    """(the line to print, whether it is a warning): the logits one decode step hands the host
    and the time reading them takes, with what on-device sampling gives up."""
    logits = batch_size * vocab
    greedy, sampled = (logits * rate / 1e6 for rate in (GREEDY_NS_PER_LOGIT,
                                                        SAMPLED_NS_PER_LOGIT))
    share = sampled / (REFERENCE_STEP_MS + sampled)
    of_step = f"{share:.0%}" if share >= 0.01 else "under 1%"
    line = (f"host sampling (estimate): each decode step hands the host {batch_size} x "
            f"{vocab:,} float32 logits ({logits * 4 / 1e6:.1f} MB): about {greedy:.2f} ms "
            f"greedy, {sampled:.2f} ms sampled, {of_step} of a {REFERENCE_STEP_MS:.0f} ms "
            "step (bench/results/host_sampling_device.md); handler.neuron.on_device_sampling: "
            "true returns token ids instead (seed, min_new_tokens, penalties, logprobs and "
            "response_format are then refused)")
    return line, share > WARN_SHARE
