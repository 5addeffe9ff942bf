#!/usr/bin/env python3
"""Writes inf2serve.json, the Grafana dashboard of an inf2serve server and its Inferentia2
device: `python deploy/grafana/make_dashboard.py` (stdlib only). Edit the panels here, not
the JSON; tests/unit/test_monitoring_rules.py checks that the JSON is this script's output.

Grafana schema 39 (Grafana 10.2 and later); a `datasource` variable picks the Prometheus
data source, `model_name` the served models and `instance_id` the Inf2 hosts. Server panels
read the metrics of handlers/telemetry/catalog.py (vLLM's names); device panels read
neuron-monitor-prometheus.py's (AWS's names, the ones its own Grafana dashboard reads).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).with_name("inf2serve.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
M = 'model_name=~"$model_name"'
I = 'instance_id=~"$instance_id"'  # noqa: E741
RATE = "$__rate_interval"


def quantiles(metric: str, qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (model_name, le) (rate({metric}_bucket{{{M}}}"
             f"[{RATE}])))", f"p{round(q * 100)} {{{{model_name}}}}") for q in qs]


def ratio(num: str, den: str, by: str = "model_name") -> str:
    return f"sum by ({by}) (rate({num}[{RATE}])) / sum by ({by}) (rate({den}[{RATE}]))"


class Layout:
    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.y = 0
        self.x = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append({"type": "row", "title": title, "collapsed": False,
                            "id": len(self.panels) + 1, "panels": [],
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}})
        self.y += 1

    def panel(self, title: str, description: str, targets: list[tuple[str, str]],
              unit: str = "short", width: int = 8, kind: str = "timeseries",
              max_value: float | None = None) -> None:
        if self.x + width > 24:
            self._newline()
        defaults: dict = {"unit": unit}
        if max_value is not None:
            defaults.update(min=0, max=max_value)
        self.panels.append({
            "type": kind, "title": title, "description": description,
            "id": len(self.panels) + 1, "datasource": DS,
            "gridPos": {"h": 8, "w": width, "x": self.x, "y": self.y},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                        "tooltip": {"mode": "multi"}},
            "targets": [{"datasource": DS, "expr": expr, "legendFormat": legend,
                         "refId": chr(ord("A") + i)}
                        for i, (expr, legend) in enumerate(targets)]})
        self.x += width

    def _newline(self) -> None:
        if self.x:
            self.x = 0
            self.y += 8


def panels() -> list[dict]:
    out = Layout()
    out.row("Load")
    out.panel("Requests running and waiting",
              "Requests generating in a slot (vllm:num_requests_running) and queued for one "
              "(vllm:num_requests_waiting), summed over the model's workers. Waiting beyond "
              "a moment means the slots are all busy: the autoscaling signal.",
              [(f"sum by (model_name) (vllm:num_requests_running{{{M}}})",
                "running {{model_name}}"),
               (f"sum by (model_name) (vllm:num_requests_waiting{{{M}}})",
                "waiting {{model_name}}")])
    out.panel("Finished requests by reason",
              "Requests per second by finish reason: stop (EOS or a stop string), length "
              "(max_tokens or the model's length), abort (the client left or cancelled), "
              "timeout (the request's deadline passed), error.",
              [(f"sum by (model_name, finished_reason) "
                f"(rate(vllm:request_success_total{{{M}}}[{RATE}]))",
                "{{finished_reason}} {{model_name}}")], unit="reqps")
    out.panel("Slot (KV cache) usage",
              "Busy slots over slots (vllm:kv_cache_usage_perc): each slot holds one "
              "sequence's whole KV cache, so 100% means a newcomer waits.",
              [(f"max by (model_name) (vllm:kv_cache_usage_perc{{{M}}})",
                "usage {{model_name}}")], unit="percentunit", max_value=1)
    out.row("Latency")
    out.panel("Time to first token",
              "From the request's arrival in the worker to its first token.",
              quantiles("vllm:time_to_first_token_seconds"), unit="s")
    out.panel("Inter-token latency",
              "Between a request's successive tokens (the decode step, as its client sees "
              "it).", quantiles("vllm:inter_token_latency_seconds"), unit="s")
    out.panel("End-to-end latency",
              "From the request's arrival in the worker to its last token.",
              quantiles("vllm:e2e_request_latency_seconds"), unit="s")
    out.panel("Queue, prefill and decode time (p90)",
              "Where a request's time goes: waiting for a slot, prefill (slot to first "
              "token), decode (first to last token).",
              [(expr, f"{phase} {{{{model_name}}}}") for phase, (expr, _) in (
                  ("queue", quantiles("vllm:request_queue_time_seconds", (0.9,))[0]),
                  ("prefill", quantiles("vllm:request_prefill_time_seconds", (0.9,))[0]),
                  ("decode", quantiles("vllm:request_decode_time_seconds", (0.9,))[0]))],
              unit="s")
    out.row("Throughput")
    out.panel("Tokens per second",
              "Prompt tokens prefilled and tokens generated (delivered) per second.",
              [(f"sum by (model_name) (rate(vllm:prompt_tokens_total{{{M}}}[{RATE}]))",
                "prompt {{model_name}}"),
               (f"sum by (model_name) (rate(vllm:generation_tokens_total{{{M}}}[{RATE}]))",
                "generation {{model_name}}")])
    out.panel("Tokens per request (p50)",
              "Median prompt and generation length of finished requests.",
              [(quantiles("vllm:request_prompt_tokens", (0.5,))[0][0], "prompt {{model_name}}"),
               (quantiles("vllm:request_generation_tokens", (0.5,))[0][0],
                "generation {{model_name}}")])
    out.panel("Requests per second",
              "Finished requests per second, all reasons.",
              [(f"sum by (model_name) (rate(vllm:request_success_total{{{M}}}[{RATE}]))",
                "{{model_name}}")], unit="reqps")
    out.row("Errors and workers")
    out.panel("Error ratio",
              "Share of finished requests that ended in an error (the alert "
              "Inf2ServeErrorRatioHigh fires above 5% for 5 minutes).",
              [(ratio(f'vllm:request_success_total{{finished_reason="error",{M}}}',
                      f"vllm:request_success_total{{{M}}}"), "{{model_name}}")],
              unit="percentunit")
    out.panel("Worker heartbeat age",
              "Seconds since each worker last reported; a live worker reports every few "
              "seconds (the alert Inf2ServeWorkerDown fires past 30 s).",
              [(f"time() - max by (model_name, worker) "
                f"(inf2serve_worker_heartbeat_timestamp_seconds{{{M}}})",
                "{{model_name}} worker {{worker}}")], unit="s")
    out.panel("Slots",
              "Slots of the running workers, and those busy.",
              [(f"sum by (model_name) (inf2serve_slots{{{M}}})", "slots {{model_name}}"),
               (f"sum by (model_name) (vllm:num_requests_running{{{M}}})",
                "busy {{model_name}}")])
    out.panel("TorchServe frontend",
              "Inference requests per second as TorchServe's frontend counts them (native "
              "and OpenAI paths), and their mean latency there (ts_inference_*; the first "
              "byte of a stream, for a streamed answer).",
              [(f"sum by (model_name) (rate(ts_inference_requests_total{{{M}}}[{RATE}]))",
                "requests/s {{model_name}}"),
               (f"sum by (model_name) (rate(ts_inference_latency_microseconds{{{M}}}[{RATE}]))"
                f" / 1e6 / sum by (model_name) (rate(ts_inference_requests_total{{{M}}}[{RATE}]))",
                "mean latency s {{model_name}}")])
    out.panel("Exporters answering",
              "Whether TorchServe's metrics port and neuron-monitor's exporter answered the "
              "router's last scrape (1) or not (0); TorchServe silent is an outage "
              "(Inf2ServeDown).",
              [("min by (instance, upstream) (inf2serve_upstream_up)",
                "{{instance}} {{upstream}}")], max_value=1)
    out.row("Speculative decoding")
    out.panel("Draft acceptance rate",
              "Accepted draft tokens over draft tokens (models compiled with a draft; empty "
              "for the others).",
              [(ratio(f"vllm:spec_decode_num_accepted_tokens_total{{{M}}}",
                      f"vllm:spec_decode_num_draft_tokens_total{{{M}}}"), "{{model_name}}")],
              unit="percentunit", max_value=1)
    out.panel("Mean acceptance length",
              "Tokens per speculative step and sequence: 1 + accepted / drafts.",
              [(f"1 + {ratio(f'vllm:spec_decode_num_accepted_tokens_total{{{M}}}', f'vllm:spec_decode_num_drafts_total{{{M}}}')}",  # noqa: E501
                "{{model_name}}")])
    out.panel("Emitted over generated tokens",
              "Tokens the device emitted per token delivered: above 1 when requests end "
              "mid-step and the rest of the step's tokens are dropped.",
              [(ratio(f"vllm:spec_decode_num_emitted_tokens_total{{{M}}}",
                      f"vllm:generation_tokens_total{{{M}}}"), "{{model_name}}")])
    out.row("Inferentia2 device (neuron-monitor)")
    out.panel("NeuronCore utilization",
              "Per NeuronCore, from neuron-monitor (neuroncore_utilization_ratio).",
              [(f"avg by (instance_id, neuroncore) (neuroncore_utilization_ratio{{{I}}})",
                "{{instance_id}} core {{neuroncore}}")], unit="percentunit", max_value=1)
    out.panel("Neuron runtime memory",
              "Memory the Neuron runtime holds, on the device and on the host.",
              [(f"sum by (instance_id, memory_location) "
                f"(neuron_runtime_memory_used_bytes{{{I}}})",
                "{{instance_id}} {{memory_location}}")], unit="bytes")
    out.panel("Device execution latency",
              "The Neuron runtime's execution latency percentiles over neuron-monitor's "
              "period.",
              [(f'avg by (percentile) (execution_latency_seconds{{percentile=~"p50|p99",{I}}})',
                "{{percentile}}")], unit="s")
    out.panel("Device executions by outcome",
              "Executions per second: completed, and every kind of failure.",
              [(f"sum by (status_type) (rate(execution_status_total{{{I}}}[{RATE}]))",
                "{{status_type}}")], unit="ops")
    return out.panels


def variable(name: str, label: str, query: str) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": DS,
            "query": {"query": query, "refId": "A"}, "definition": query, "refresh": 2,
            "multi": True, "includeAll": True, "allValue": ".*", "sort": 1,
            "current": {"text": "All", "value": "$__all"}}


def dashboard() -> dict:
    return {
        "title": "inf2serve", "uid": "inf2serve", "schemaVersion": 39, "version": 1,
        "description": "An inf2serve server (vLLM's metric names) and its Inferentia2 "
                       "devices (neuron-monitor).",
        "tags": ["inf2serve", "llm", "inferentia2"], "timezone": "browser",
        "editable": True, "refresh": "30s", "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource",
             "query": "prometheus", "current": {}},
            variable("model_name", "Model", "label_values(vllm:num_requests_running, model_name)"),
            variable("instance_id", "Inf2 host",
                     "label_values(neuroncore_utilization_ratio, instance_id)")]},
        "annotations": {"list": []},
        "panels": panels(),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=1) + "\n"


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    target.write_text(render())
    print(f"wrote {target}")
