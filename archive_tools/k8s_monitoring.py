"""`inf2serve export --target kubernetes --monitoring`: what the Prometheus operator needs to
scrape the server and its Inferentia2 devices.

- A PodMonitor for the server's pods (the router's port: its /metrics carries every
  worker's metrics and TorchServe's, every 15 s), which the operator's Prometheus picks up
  by its podMonitorSelector (docs/monitoring.md).
- For a Neuron model, AWS's neuron-monitor DaemonSet and its PodMonitor: neuron-monitor and
  its Prometheus exporter in one privileged pod per Inf2 node, as AWS's EKS monitoring runs
  them (aws-neuron/aws-neuron-sdk@81ce03ae:src/k8/k8s-neuron-monitor-daemonset.yml: image,
  entrypoint, port 8000, resources, GOMEMLIMIT, privileged). Two changes: the toleration of
  the `aws.amazon.com/neuron` taint that Inf2 node groups carry (the pods of this export
  tolerate it too), and the port named for the PodMonitor. The device is the node's, not a
  pod's, so the DaemonSet has one fixed name: every export's copy is the same object, and
  applying a second export's changes nothing.

PodMonitor is a custom resource of the Prometheus operator (monitoring.coreos.com/v1): a
cluster without the operator refuses it, so these objects come only with --monitoring.
"""

from __future__ import annotations

from typing import Any

from archive_tools.neuron_sizing import INSTANCES

PODMONITOR_API = "monitoring.coreos.com/v1"
SCRAPE_INTERVAL = "15s"
NEURON_MONITOR = "neuron-monitor"
NEURON_MONITOR_IMAGE = "public.ecr.aws/neuron/neuron-monitor:1.3.0"
NEURON_MONITOR_PORT = 8000


def _labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "inf2serve"}


def pod_monitor(name: str, ns: str, selector: str, port: str) -> dict:
    return {"apiVersion": PODMONITOR_API, "kind": "PodMonitor",
            "metadata": {"name": name, "namespace": ns, "labels": _labels(name)},
            "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": selector}},
                     "podMetricsEndpoints": [{"port": port, "path": "/metrics",
                                              "interval": SCRAPE_INTERVAL}]}}


def neuron_monitor_daemonset(ns: str) -> dict:
    selector = {"app.kubernetes.io/name": NEURON_MONITOR}
    container: dict[str, Any] = {
        "name": NEURON_MONITOR,
        "image": NEURON_MONITOR_IMAGE,
        "command": ["/opt/bin/entrypoint.sh"],
        "args": ["--port", str(NEURON_MONITOR_PORT), "--neuron-monitor-config",
                 "/opt/aws/neuron/bin/neuron-monitor.conf"],
        "ports": [{"name": "metrics", "containerPort": NEURON_MONITOR_PORT}],
        "resources": {"limits": {"cpu": "500m", "memory": "256Mi"},
                      "requests": {"cpu": "256m", "memory": "128Mi"}},
        "env": [{"name": "GOMEMLIMIT", "value": "160MiB"}],
        "securityContext": {"privileged": True},  # reads the Neuron driver's devices
    }
    return {"apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": NEURON_MONITOR, "namespace": ns,
                         "labels": _labels(NEURON_MONITOR)},
            "spec": {"selector": {"matchLabels": selector},
                     "template": {"metadata": {"labels": _labels(NEURON_MONITOR)}, "spec": {
                         "affinity": {"nodeAffinity": {
                             "requiredDuringSchedulingIgnoredDuringExecution": {
                                 "nodeSelectorTerms": [{"matchExpressions": [
                                     {"key": "kubernetes.io/os", "operator": "In",
                                      "values": ["linux"]},
                                     {"key": "node.kubernetes.io/instance-type",
                                      "operator": "In", "values": sorted(INSTANCES)}]}]}}},
                         "tolerations": [{"key": "aws.amazon.com/neuron",
                                          "operator": "Exists", "effect": "NoSchedule"}],
                         "containers": [container]}}}}


def monitoring_objects(name: str, ns: str, port: str, neuron: bool) -> dict[str, dict]:
    """file name -> object: the server's PodMonitor (scraping `port`), and for a Neuron
    model neuron-monitor's DaemonSet and PodMonitor."""
    objects = {"podmonitor.yaml": pod_monitor(name, ns, name, port)}
    if neuron:
        objects["neuron-monitor-daemonset.yaml"] = neuron_monitor_daemonset(ns)
        objects["neuron-monitor-podmonitor.yaml"] = pod_monitor(
            NEURON_MONITOR, ns, NEURON_MONITOR, "metrics")
    return objects
