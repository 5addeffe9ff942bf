#!/usr/bin/env python3
"""Fake `neuron-monitor-prometheus.py` (aws-neuronx-tools, installed to /opt/aws/neuron/bin):
reads neuron-monitor's reports from stdin, one JSON object a line, and serves them to
Prometheus on `--port` (default 8000) with prometheus_client's default registry.

Usage and options as aws-neuron/aws-neuron-sdk@81ce03ae:tools/neuron-sys-tools/
neuron-monitor-user-guide.rst:850-877 gives them (`neuron-monitor | neuron-monitor-prometheus.py
--port 8008`). The series it exports are those AWS's Grafana dashboard for it queries
(src/examples/neuron-monitor/neuron-monitor-grafana.json:123-1515): `instance_info`,
`neuroncore_utilization_ratio` (by `neuroncore`), `neuron_runtime_memory_used_bytes` (by
`memory_location`: host, neuron_device), `execution_latency_seconds` (by `percentile`),
`execution_status_total` (by `status_type`), `neuron_runtime_vcpu_usage_ratio` and
`system_vcpu_usage_ratio` (by `usage_type`), `system_vcpu_count`,
`system_memory_{used,total}_bytes`; the real script also exports the per-core memory
breakdown (`neuroncore_memory_usage_{constants,model_code,model_shared_scratchpad,
runtime_memory,tensors}`), `execution_errors_total` (by `error_type`),
`hardware_ecc_events_total` and `neuron_hardware_info`, which are mirrored too. Every series
carries the instance's labels (instance_name, instance_id, instance_type,
availability_zone, region, subnet_id), a runtime's also `runtime_tag`; percentages arrive
as ratios (utilization / 100); counters add each report's per-period counts; a report
without Neuron applications clears the runtime series. What it does not model: TLS
options, the k8s-info companion; at the end of its input the real one spins on, this one exits.
"""

import argparse
import json
import sys

from prometheus_client import Counter, Gauge, Info, start_http_server

INSTANCE = {"instance_name": "instance_name", "instance_id": "instance_id",
            "instance_type": "instance_type", "availability_zone": "instance_availability_zone",
            "region": "instance_region", "subnet_id": "subnet_id"}
CORE_MEMORY = ("constants", "model_code", "model_shared_scratchpad", "runtime_memory", "tensors")


class Exporter:
    def __init__(self) -> None:
        self.metrics: dict[str, Gauge | Counter] = {}
        self.instance: dict[str, str] | None = None
        self.runtime_metrics: set[str] = set()

    def metric(self, kind: type, name: str, doc: str, labels: dict, runtime: bool = False):
        if name not in self.metrics:
            self.metrics[name] = kind(name, doc, list(labels))
        if runtime:
            self.runtime_metrics.add(name)
        return self.metrics[name].labels(**labels)

    def runtime(self, labels: dict, group: str, data: dict) -> None:
        if group == "neuroncore_counters":
            for core, values in data["neuroncores_in_use"].items():
                self.metric(Gauge, "neuroncore_utilization_ratio", "NeuronCore utilization",
                            {**labels, "neuroncore": core}, True).set(
                    values["neuroncore_utilization"] / 100)
        elif group == "memory_used":
            used = data["neuron_runtime_used_bytes"]
            for where in ("host", "neuron_device"):
                self.metric(Gauge, "neuron_runtime_memory_used_bytes", "Runtime memory used",
                            {**labels, "memory_location": where}, True).set(used[where])
            per_core = used["usage_breakdown"]["neuroncore_memory_usage"]
            for kind in CORE_MEMORY:
                for core, values in per_core.items():
                    self.metric(Gauge, f"neuroncore_memory_usage_{kind}",
                                f"NeuronCore memory used for {kind}",
                                {**labels, "neuroncore": core, "memory_location": "None"},
                                True).set(values[kind])
        elif group == "neuron_runtime_vcpu_usage":
            for usage in ("user", "system"):
                self.metric(Gauge, "neuron_runtime_vcpu_usage_ratio", "Runtime vCPU usage",
                            {**labels, "usage_type": usage}, True).set(
                    data["vcpu_usage"][usage] / 100)
        elif group == "execution_stats":
            for kind, count in data["error_summary"].items():
                self.metric(Counter, "execution_errors", "Execution errors",
                            {**labels, "error_type": kind}, True).inc(count)
            for status, count in data["execution_summary"].items():
                self.metric(Counter, "execution_status", "Execution status",
                            {**labels, "status_type": status}, True).inc(count)
            latency = data["latency_stats"]["total_latency"]
            for percentile, value in (latency or {}).items():
                self.metric(Gauge, "execution_latency_seconds", "Execution latency",
                            {**labels, "percentile": percentile}, True).set(value)

    def system(self, labels: dict, group: str, data: dict) -> None:
        if group == "vcpu_usage":
            self.metric(Gauge, "system_vcpu_count", "System vCPU count", labels).set(
                len(data["usage_data"]))
            avg = data["average_usage"]
            for usage, parts in (("user", ("user", "nice")),
                                 ("system", ("system", "io_wait", "irq", "soft_irq"))):
                self.metric(Gauge, "system_vcpu_usage_ratio", "System vCPU usage",
                            {**labels, "usage_type": usage}).set(
                    min(sum(avg[p] for p in parts), 100) / 100)
        elif group == "memory_info":
            for prefix, source in (("system_memory", "memory"), ("system_swap", "swap")):
                for stat in ("total_bytes", "used_bytes"):
                    self.metric(Gauge, f"{prefix}_{stat}", f"System {source} {stat}",
                                labels).set(data[f"{source}_{stat}"])
        elif group == "neuron_hw_counters":
            for device in data["neuron_devices"]:
                for event in ("mem_ecc_corrected", "mem_ecc_uncorrected",
                              "sram_ecc_corrected", "sram_ecc_uncorrected"):
                    self.metric(Counter, "hardware_ecc_events", "Hardware ECC events",
                                {**labels, "event_type": event,
                                 "neuron_device_index": str(device["neuron_device_index"])}
                                ).inc(device[event])

    def update(self, report: dict) -> None:
        if self.instance is None:
            info = report["instance_info"]
            self.instance = {label: str(info.get(key, "")) for label, key in INSTANCE.items()}
            Info("instance", "EC2 instance information").info(self.instance)
            hw = report.get("neuron_hardware_info")
            if hw:
                Info("neuron_hardware", "Neuron hardware information").info({
                    **self.instance, "neuron_device_count": str(hw["neuron_device_count"]),
                    "neuroncore_per_device_count": str(hw["neuroncore_per_device_count"])})
        runtimes = report.get("neuron_runtime_data") or []
        if not runtimes:  # nothing runs on the device: no runtime series
            for name in self.runtime_metrics:
                self.metrics[name].clear()
        for app in runtimes:
            if app["error"]:
                print(f"runtime {app['neuron_runtime_tag']} error: {app['error']}",
                      file=sys.stderr)
                continue
            labels = {**self.instance, "runtime_tag": app["neuron_runtime_tag"]}
            for group, data in app["report"].items():
                if not data["error"]:
                    self.runtime(labels, group, data)
        for group, data in (report.get("system_data") or {}).items():
            if not data["error"]:
                self.system(dict(self.instance), group, data)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("-p", "--port", type=int, default=8000)
    args = parser.parse_args()
    start_http_server(args.port)
    exporter = Exporter()
    for line in sys.stdin:
        try:
            report = json.loads(line)
        except ValueError as exc:
            print(f"Unable to decode JSON {exc}")
            continue
        exporter.update(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
