"""The server's one /metrics body: every worker's values (`recorder`'s files, merged by
prometheus_client's MultiProcessCollector: counters and histograms summed over workers,
gauges by their family's mode), what is computed from them, and the text of the
exporters beside the server (TorchServe's own metrics port, neuron-monitor's exporter),
appended as they answered.

Appending is safe because no two sources share a metric name: ours are `vllm:` and
`inf2serve_`, TorchServe's are `ts_` and its CamelCase names, neuron-monitor's are AWS's
(`neuroncore_`, `neuron_`, `execution_`, `system_`, `instance_info`, and the Python process
metrics of its client library, which this body leaves out of its own part).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from handlers.telemetry.catalog import BY_NAME, MODEL_LABEL

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _ServerCollector:
    """The workers' files, plus slot usage per model (busy over slots, summed over its
    workers: a ratio cannot be summed, so no worker writes it)."""

    def __init__(self, directory: Path) -> None:
        from prometheus_client.multiprocess import MultiProcessCollector

        self._files = MultiProcessCollector(None, path=str(directory))

    def collect(self) -> Iterator:
        from prometheus_client.core import GaugeMetricFamily

        running: dict[str, float] = {}
        slots: dict[str, float] = {}
        for family in self._files.collect():
            if family.name in ("vllm:num_requests_running", "inf2serve_slots"):
                into = running if family.name == "vllm:num_requests_running" else slots
                for sample in family.samples:
                    model = sample.labels.get(MODEL_LABEL, "")
                    into[model] = into.get(model, 0.0) + sample.value
            yield family
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc",
                                  BY_NAME["vllm:kv_cache_usage_perc"].doc, labels=[MODEL_LABEL])
        for model, total in sorted(slots.items()):
            usage.add_metric([model], running.get(model, 0.0) / total if total else 0.0)
        yield usage


def render(directory: Path | None, upstreams: Sequence[tuple[str, bytes | None]] = ()) -> bytes:
    """The /metrics body: the workers' metrics (from `directory`; none while it is None or
    missing), `inf2serve_upstream_up` for each upstream exporter (1 when it answered, None
    for one that did not), then each answer's text."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import GaugeMetricFamily

    registry = CollectorRegistry(auto_describe=False)
    if directory is not None and directory.is_dir():
        registry.register(_ServerCollector(directory))
    up = GaugeMetricFamily("inf2serve_upstream_up", BY_NAME["inf2serve_upstream_up"].doc,
                           labels=["upstream"])
    for name, text in upstreams:
        up.add_metric([name], 0.0 if text is None else 1.0)

    class _Up:
        def collect(self) -> Iterator:
            yield up

    registry.register(_Up())
    parts = [generate_latest(registry)]
    for _, text in upstreams:
        if text:
            parts.append(text if text.endswith(b"\n") else text + b"\n")
    return b"".join(parts)
