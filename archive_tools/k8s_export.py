"""`inf2serve export --target kubernetes`: plain, kustomize-ready manifests for one archive.

OUT holds one file per object plus kustomization.yaml (`kubectl apply -k OUT`), the
archive under model-store/, and the Dockerfile of the model image (FROM the base image
of deploy/Dockerfile, adding model-store/). The compile cache travels inside the archive
and so inside the image: every replica on every node starts warm, with no shared volume
(an EBS volume attaches to one node) and no second copy to keep in step with the SDK the
image pins (an entry's key holds the SDK versions).

TorchServe runs as stock, from the exported config.properties: inference and metrics on
the pod's address for in-cluster traffic (the Service is ClusterIP; the platform's gateway
authenticates, so TorchServe's token auth is off as in the SageMaker and KServe exports),
management and gRPC on 127.0.0.1 with the model API off. The frontend JVM's memory is
bounded by config.properties' `vmargs` (archive_tools/jvm_options.py), and the container's
memory request and limit carry that budget next to the workers' (archive_tools/k8s_plan.py),
so growth the JVM is allowed cannot get the pod OOM-killed. Probes run inside the container
(probe.py, stdlib only): liveness asks /ping, readiness asks the loopback management API
for a READY worker (TorchServe 0.12's /ping stays 200 while workers load). Beside it, the
image's OpenAI router (archive_tools/openai_router.py) gives the pod one OpenAI base URL
and its one /metrics: every worker's metrics under vLLM's names (written to an emptyDir both
containers mount), then TorchServe's own; Prometheus scrapes that port, and the HPA scales
on its load gauges through the Prometheus adapter.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from archive_tools.jvm_options import FrontendMemory
from archive_tools.k8s_monitoring import monitoring_objects
from archive_tools.k8s_plan import PodPlan
from handlers.telemetry.recorder import METRICS_DIR_ENV

VERSION = "0.1.0"  # pyproject's version (a test checks): the base image tag carries it
INFERENCE_PORT, MANAGEMENT_PORT, METRICS_PORT = 8080, 8081, 8082
#: the router beside TorchServe: the one OpenAI base URL and the pod's /metrics
ROUTER_PORT = 8090
#: where the workers write their metrics and the router reads them (an emptyDir both mount)
WORKER_METRICS_DIR = "/var/run/inf2serve-metrics"
CONFIG_DIR = "/etc/inf2serve"
MODEL_STORE = "/models/model-store"
PROBE_PERIOD_S = 10
#: the load gauges (vLLM's names, summed over workers by the router's /metrics) as the
#: Prometheus adapter names them for the HPA
WAITING, BUSY = "inf2serve_waiting_requests", "inf2serve_busy_slots"
ADAPTED = {WAITING: "vllm:num_requests_waiting", BUSY: "vllm:num_requests_running"}
NVIDIA_GPU_TAINT = "nvidia.com/gpu"  # the taint EKS GPU node groups commonly carry

PROBE = Path(__file__).parent / "data" / "k8s_probe.py"  # ports as above


@dataclass(frozen=True)
class K8sOptions:
    image: str = ""  # default: NAME:VERSION
    replicas: int = 1
    instance: str | None = None  # None: any Inf2 size that fits
    namespace: str = "default"
    #: a PodMonitor for the server, and for a Neuron model neuron-monitor's DaemonSet and
    #: PodMonitor (archive_tools/k8s_monitoring.py)
    monitoring: bool = False

    def image_for(self, name: str) -> str:
        return self.image or f"{name}:{VERSION}"


def base_image(plan: PodPlan, backend: str) -> str:
    """The deploy/Dockerfile build the model image starts FROM."""
    profile = backend if plan.accelerator == "neuron" else plan.accelerator
    return f"inf2serve-base:{VERSION}-{profile}"


def config_properties(name: str, archive: str, cfg: dict,
                      frontend: FrontendMemory | None = None) -> str:
    """The pod's TorchServe config; `vmargs` bounds the frontend JVM (`frontend`, default
    FrontendMemory()) as the container's memory assumes."""
    props = {
        "inference_address": f"http://0.0.0.0:{INFERENCE_PORT}",
        "management_address": f"http://127.0.0.1:{MANAGEMENT_PORT}",
        "metrics_address": f"http://0.0.0.0:{METRICS_PORT}",
        # gRPC binds 127.0.0.1 by default (ConfigManager.java:397-402); said explicitly
        "grpc_inference_address": "127.0.0.1",
        "grpc_management_address": "127.0.0.1",
        "model_store": MODEL_STORE,
        "load_models": f"{name}={archive}",
        "disable_token_authorization": "true",
        "enable_model_api": "false",
        "install_py_dep_per_model": "false",
        "default_response_timeout": str(cfg["responseTimeout"]),
        "metrics_mode": "prometheus",
        "model_metrics_auto_detect": "true",  # the handler's WaitingRequests / BusySlots
        "enable_envvars_config": "false",
        "vmargs": (frontend or FrontendMemory()).vmargs(),
    }
    return "".join(f"{k}={v}\n" for k, v in props.items())


def _meta(name: str, namespace: str, **extra: Any) -> dict:
    return {"name": name, "namespace": namespace,
            "labels": {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "inf2serve"},
            **extra}


def _exec(*args: str) -> dict:
    return {"exec": {"command": ["python3", f"{CONFIG_DIR}/probe.py", *args]}}


def container(name: str, archive: str, image: str, plan: PodPlan) -> dict:
    res: dict[str, Any] = {"cpu": str(plan.cpu), "memory": f"{plan.memory_mi}Mi"}
    limits: dict[str, Any] = {"memory": f"{plan.memory_limit_mi}Mi"}
    if plan.device_resource:  # extended resources: limits required, requests must equal them
        res[plan.device_resource] = limits[plan.device_resource] = plan.devices
    return {
        "name": "torchserve",
        "image": image,
        "command": ["torchserve"],
        "args": ["--start", "--foreground", "--ncs", "--ts-config",
                 f"{CONFIG_DIR}/config.properties", "--model-store", MODEL_STORE,
                 "--models", f"{name}={archive}"],
        "workingDir": "/tmp",
        "env": [{"name": "LOG_LOCATION", "value": "/tmp/logs"},
                {"name": "METRICS_LOCATION", "value": "/tmp/logs"},
                {"name": "TEMP", "value": "/tmp"},
                {"name": METRICS_DIR_ENV, "value": WORKER_METRICS_DIR}],
        "ports": [{"name": "http", "containerPort": INFERENCE_PORT},
                  {"name": "metrics", "containerPort": METRICS_PORT}],
        "resources": {"requests": res, "limits": limits},
        "startupProbe": {**_exec("ready", name), "periodSeconds": PROBE_PERIOD_S,
                         "timeoutSeconds": 8,
                         "failureThreshold": math.ceil(plan.startup_s / PROBE_PERIOD_S)},
        "readinessProbe": {**_exec("ready", name), "periodSeconds": PROBE_PERIOD_S,
                           "timeoutSeconds": 8, "failureThreshold": 3},
        "livenessProbe": {**_exec("live"), "periodSeconds": 30, "timeoutSeconds": 10,
                          "failureThreshold": 3},
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "dshm", "mountPath": "/dev/shm"},
                         {"name": "metrics", "mountPath": WORKER_METRICS_DIR}],
        "securityContext": {"allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
    }


def router_container(name: str, version: str, image: str) -> dict:
    """archive_tools/openai_router.py beside TorchServe, from the same image: the one OpenAI
    base URL and the pod's /metrics (the workers' files, then TorchServe's metrics port)."""
    return {
        "name": "router",
        "image": image,
        "command": ["python3", "-m", "archive_tools.openai_router"],
        "args": ["--upstream", f"http://127.0.0.1:{INFERENCE_PORT}", "--model",
                 f"{name}={version}", "--host", "0.0.0.0", "--port", str(ROUTER_PORT),
                 "--metrics-dir", WORKER_METRICS_DIR, "--metrics-from",
                 f"torchserve=http://127.0.0.1:{METRICS_PORT}/metrics"],
        "workingDir": "/tmp",
        "ports": [{"name": "router", "containerPort": ROUTER_PORT}],
        "resources": {"requests": {"cpu": "250m", "memory": "192Mi"},
                      "limits": {"memory": "512Mi"}},
        "livenessProbe": {"tcpSocket": {"port": "router"}, "periodSeconds": 30,
                          "timeoutSeconds": 5, "failureThreshold": 3},
        "volumeMounts": [{"name": "metrics", "mountPath": WORKER_METRICS_DIR,
                          "readOnly": True}],
        "securityContext": {"allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
    }


def scheduling(plan: PodPlan) -> dict:
    """Node affinity on the well-known instance-type label, and the node group's taint."""
    spec: dict[str, Any] = {}
    if plan.instances:
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{
                "key": "node.kubernetes.io/instance-type", "operator": "In",
                "values": list(plan.instances)}]}]}}}
    if plan.accelerator == "neuron":  # Inf2 node groups are tainted aws.amazon.com/neuron
        spec["tolerations"] = [{"key": "aws.amazon.com/neuron", "operator": "Exists",
                                "effect": "NoSchedule"}]
    elif plan.accelerator == "gpu":
        spec["tolerations"] = [{"key": NVIDIA_GPU_TAINT, "operator": "Exists",
                                "effect": "NoSchedule"}]
    return spec


def deployment(name: str, ns: str, archive: str, image: str, replicas: int, plan: PodPlan,
               props: str, version: str = "1.0") -> dict:
    labels = {"app.kubernetes.io/name": name}
    pod_annotations = {
        "prometheus.io/scrape": "true", "prometheus.io/port": str(ROUTER_PORT),
        "prometheus.io/path": "/metrics",
        "inf2serve/config-sha256": hashlib.sha256(props.encode()).hexdigest()[:16]}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _meta(name, ns, annotations={
            "inf2serve/memory-estimate": f"{plan.memory_gib:.1f} GiB ({plan.memory_source}; "
                                         "inf2serve validate)",
            "inf2serve/memory-request": f"{plan.memory_mi} MiB: workers "
                                        f"{math.ceil(plan.workers_gib * 1024)} + frontend "
                                        f"{plan.frontend_mi} (JVM budget "
                                        f"{plan.frontend.budget_mib}, launcher and probes)"}),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            # one pod's devices at a time: surge would need a spare node's worth of cores
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": 0 if plan.devices else 1,
                                           "maxUnavailable": 1}},
            "template": {
                "metadata": {"labels": {**labels, "app.kubernetes.io/part-of": "inf2serve"},
                             "annotations": pod_annotations},
                "spec": {
                    "terminationGracePeriodSeconds": 60,
                    "containers": [container(name, archive, image, plan),
                                   router_container(name, version, image)],
                    "volumes": [
                        {"name": "config", "configMap": {"name": f"{name}-config"}},
                        {"name": "dshm", "emptyDir": {"medium": "Memory",
                                                      "sizeLimit": f"{plan.shm_gib}Gi"}},
                        # a few memory-mapped files per worker (1 MiB each), on disk
                        {"name": "metrics", "emptyDir": {"sizeLimit": "256Mi"}}],
                    **scheduling(plan)}}}}


def service(name: str, ns: str) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, ns), "spec": {
        "type": "ClusterIP", "selector": {"app.kubernetes.io/name": name},
        "ports": [{"name": "http", "port": INFERENCE_PORT, "targetPort": "http"},
                  {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"},
                  {"name": "router", "port": ROUTER_PORT, "targetPort": "router"}]}}


def pdb(name: str, ns: str) -> dict:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(name, ns), "spec": {
                "maxUnavailable": 1,  # drains go one pod at a time, and a single replica can go
                "selector": {"matchLabels": {"app.kubernetes.io/name": name}}}}


def hpa_targets(cfg: dict) -> tuple[int, int]:
    """(waiting requests, busy slots) per pod at which to add one: a request waiting per
    worker, or 80% of the slots busy."""
    workers, batch = cfg["maxWorkers"], cfg["handler"]["batch_size"]
    return workers, max(1, math.floor(0.8 * workers * batch))


def hpa(name: str, ns: str, replicas: int, cfg: dict) -> dict:
    waiting, busy = hpa_targets(cfg)

    def pods(metric: str, value: int) -> dict:
        return {"type": "Pods", "pods": {"metric": {"name": metric},
                                         "target": {"type": "AverageValue",
                                                    "averageValue": str(value)}}}

    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": _meta(name, ns), "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                "minReplicas": replicas, "maxReplicas": replicas * 4,
                "metrics": [pods(WAITING, waiting), pods(BUSY, busy),
                            # fallback: scales up on CPU alone when the adapter is absent
                            {"type": "Resource", "resource": {"name": "cpu", "target": {
                                "type": "Utilization", "averageUtilization": 80}}}],
                "behavior": {  # a new pod takes minutes to load: add fast, remove slowly
                    "scaleUp": {"stabilizationWindowSeconds": 0},
                    "scaleDown": {"stabilizationWindowSeconds": 600}}}}


def adapter_values() -> dict:
    """Helm values of prometheus-community/prometheus-adapter exposing the load gauges per
    pod (the series carry namespace and pod from Prometheus' pod discovery)."""
    def rule(metric: str, series: str) -> dict:
        return {"seriesQuery": f'{series}{{namespace!="",pod!=""}}',
                "resources": {"overrides": {"namespace": {"resource": "namespace"},
                                            "pod": {"resource": "pod"}}},
                "name": {"matches": f"^{series}$", "as": metric},
                # one series per model: a pod's load is their sum
                "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)"}
    return {"rules": {"default": True, "custom": [rule(m, s) for m, s in ADAPTED.items()]}}


def configmap(name: str, ns: str, props: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(f"{name}-config", ns),
            "data": {"config.properties": props, "probe.py": PROBE.read_text()}}


def model_dockerfile(base: str) -> str:
    return (f"# The model image: the base image (deploy/Dockerfile) plus this archive, compile\n"
            f"# cache included. docker build -t IMAGE {{this folder}}\n"
            f"ARG BASE={base}\nFROM ${{BASE}}\nCOPY model-store/ {MODEL_STORE}/\n")


def write_manifests(out: Path, name: str, archive: str, cfg: dict, plan: PodPlan, *,
                    image: str, replicas: int, namespace: str,
                    monitoring: bool = False, version: str = "1.0") -> list[str]:
    """Write every object and kustomization.yaml into `out`; returns the resource files."""
    props = config_properties(name, archive, cfg, plan.frontend)
    objects = {
        "configmap.yaml": configmap(name, namespace, props),
        "deployment.yaml": deployment(name, namespace, archive, image, replicas, plan, props,
                                      version),
        "service.yaml": service(name, namespace),
        "pdb.yaml": pdb(name, namespace),
        "hpa.yaml": hpa(name, namespace, replicas, cfg),
    }
    if monitoring:
        objects.update(monitoring_objects(name, namespace, "router",
                                          neuron=plan.accelerator == "neuron"))
    if namespace != "default":
        objects = {"namespace.yaml": {"apiVersion": "v1", "kind": "Namespace",
                                      "metadata": {"name": namespace}}, **objects}
    for file, obj in objects.items():
        (out / file).write_text(yaml.safe_dump(obj, sort_keys=False))
    (out / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "namespace": namespace, "resources": list(objects)}, sort_keys=False))
    (out / "prometheus-adapter-values.yaml").write_text(
        "# helm upgrade --install prometheus-adapter prometheus-community/prometheus-adapter \\\n"
        "#   -n monitoring -f prometheus-adapter-values.yaml   (set prometheus.url too)\n"
        + yaml.safe_dump(adapter_values(), sort_keys=False))
    (out / "Dockerfile").write_text(model_dockerfile(base_image(plan, cfg["handler"]["backend"])))
    (out / ".dockerignore").write_text("*\n!model-store\n")
    (out / "plan.json").write_text(json.dumps({
        "image": image, "base_image": base_image(plan, cfg["handler"]["backend"]),
        "accelerator": plan.accelerator, "device_resource": plan.device_resource,
        "devices": plan.devices, "memory_gib": round(plan.memory_gib, 2),
        "memory_source": plan.memory_source, "memory_request_mib": plan.memory_mi,
        "memory_limit_mib": plan.memory_limit_mi, "frontend_memory_mib": plan.frontend_mi,
        "frontend_vmargs": plan.frontend.vmargs(), "instances": list(plan.instances),
        "startup_s": plan.startup_s, "cache_warm": plan.cache_warm}, indent=1))
    return list(objects)


def next_steps_k8s(out: Path, name: str, cfg: dict, plan: PodPlan, opts: K8sOptions) -> str:
    base, image = base_image(plan, cfg["handler"]["backend"]), opts.image_for(name)
    profile = base.rsplit("-", 1)[1]
    devices = f"{plan.devices} x {plan.device_resource}" if plan.device_resource else "no devices"
    where = ", ".join(plan.instances) or "any node"
    warned = "".join(f"\n  # warning: {w}" for w in plan.warnings)
    watched = ("\n  # --monitoring: the PodMonitors need the Prometheus operator; Grafana: "
               "deploy/grafana/inf2serve.json" if opts.monitoring else "")
    memory = (f"{plan.memory_mi / 1024:.1f} GiB (workers {plan.workers_gib:.1f} GiB: "
              f"{plan.memory_source}, `inf2serve validate`'s estimate; frontend "
              f"{plan.frontend_mi} MiB, heap {plan.frontend.heap_mib} MiB)")
    steps = f"""pod: {devices}, {plan.cpu} CPU, memory {memory}, /dev/shm {plan.shm_gib} GiB, \
nodes: {where}{warned}
next:
  # the base image, once per toolkit version and profile (from a clone of this repository):
  docker build -f deploy/Dockerfile --build-arg PROFILE={profile} -t {base} .
  # the model image this export expects ({image}), FROM {base}:
  docker build -t {image} {out} && docker push {image}
  kubectl apply -k {out}
  kubectl -n {opts.namespace} rollout status deployment/{name}
  # autoscaling on vllm:num_requests_waiting/running: helm install prometheus-adapter with
  #   {out}/prometheus-adapter-values.yaml (until then the HPA scales up on CPU alone)
  # the Service is ClusterIP: put your authenticating gateway in front of {name}:{INFERENCE_PORT}"""
    return steps + watched
