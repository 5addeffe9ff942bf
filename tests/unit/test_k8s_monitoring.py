"""`inf2serve export --target kubernetes --monitoring`: the server's PodMonitor and, for a
Neuron model, AWS's neuron-monitor DaemonSet with its PodMonitor -- schema-valid for the
Kubernetes versions the export is tested on, the PodMonitors against the operator's CRD
schema, and each selecting the pods and port it is meant to scrape."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from archive_tools.cli import main
from archive_tools.k8s_monitoring import NEURON_MONITOR_IMAGE
from archive_tools.neuron_sizing import INSTANCES
from archive_tools.package import package
from tests.unit.test_k8s_export import CONFIG, K8S_VERSIONS, VARIANTS

ROOT = Path(__file__).resolve().parents[2]
#: the operator's PodMonitor v1 schema (tests/data/README.md says where it is from)
PODMONITOR_SCHEMA = json.loads((ROOT / "tests" / "data" / "podmonitor-v1.schema.json").read_text())


@pytest.fixture(scope="module")
def exported(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("k8s-monitoring")
    out = {}
    for kind in ("cpu", "neuron"):
        text = CONFIG.read_text()
        for old, new in VARIANTS[kind].items():
            text = text.replace(old, new)
        (tmp / f"{kind}.yaml").write_text(text)
        archive = package(tmp / f"{kind}.yaml", tiny_checkpoint, f"tiny-{kind}", "no-archive",
                          tmp / "store")
        out[kind] = tmp / f"out-{kind}"
        assert main(["export", "--target", "kubernetes", str(archive), str(out[kind]),
                     "--namespace", "llm", "--monitoring"]) == 0
    return out


def objects(out: Path) -> list[dict]:
    kust = yaml.safe_load((out / "kustomization.yaml").read_text())
    return [yaml.safe_load((out / f).read_text()) for f in kust["resources"]]


def strict(schema: dict) -> dict:
    """The schema with unknown fields refused wherever it lists the known ones (the API
    server's strict field validation, `kubectl apply --validate=strict`)."""
    schema = copy.deepcopy(schema)

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_neuron_monitor_daemonset_validates(exported: dict[str, Path], version: str) -> None:
    builtin = [o for o in objects(exported["neuron"]) if o["kind"] != "PodMonitor"]
    assert "DaemonSet" in {o["kind"] for o in builtin}
    for obj in builtin:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']} on {version}: {exc.caught.message} at "
                        f"{list(exc.caught.absolute_path)}")


def test_pod_monitors_validate_against_the_operators_crd(exported: dict[str, Path]) -> None:
    validator = jsonschema.Draft7Validator(strict(PODMONITOR_SCHEMA))
    monitors = [o for out in exported.values() for o in objects(out) if o["kind"] == "PodMonitor"]
    assert len(monitors) == 3  # the cpu server's; the neuron server's and neuron-monitor's
    for obj in monitors:
        errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(obj)]
        assert not errors, (obj["metadata"]["name"], errors)
    misspelt = copy.deepcopy(monitors[0])
    misspelt["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    assert not validator.is_valid(misspelt)  # the check can fail


def test_each_pod_monitor_selects_its_pods_and_port(exported: dict[str, Path]) -> None:
    objs = {(o["kind"], o["metadata"]["name"]): o for o in objects(exported["neuron"])}
    for monitor, workload in ((("PodMonitor", "tiny-neuron"), ("Deployment", "tiny-neuron")),
                              (("PodMonitor", "neuron-monitor"), ("DaemonSet", "neuron-monitor"))):
        spec, template = objs[monitor]["spec"], objs[workload]["spec"]["template"]
        assert spec["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
        ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        assert {e["port"] for e in spec["podMetricsEndpoints"]} <= ports
        assert objs[monitor]["metadata"]["namespace"] == "llm"


def test_neuron_monitor_runs_as_aws_runs_it_on_every_inf2_node(exported: dict[str, Path]) -> None:
    ds = next(o for o in objects(exported["neuron"]) if o["kind"] == "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert c["image"] == NEURON_MONITOR_IMAGE and c["command"] == ["/opt/bin/entrypoint.sh"]
    assert c["args"][:2] == ["--port", "8000"] and c["securityContext"]["privileged"]
    term = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    types = next(e for e in term["nodeSelectorTerms"][0]["matchExpressions"]
                 if e["key"] == "node.kubernetes.io/instance-type")
    assert sorted(types["values"]) == sorted(INSTANCES)  # every Inf2 size, not only the pod's
    assert {"key": "aws.amazon.com/neuron", "operator": "Exists",
            "effect": "NoSchedule"} in spec["tolerations"]


def test_a_cpu_model_gets_no_device_monitor(exported: dict[str, Path]) -> None:
    kinds = sorted(o["kind"] for o in objects(exported["cpu"]))
    assert kinds.count("PodMonitor") == 1 and "DaemonSet" not in kinds


def test_monitoring_is_opt_in_and_for_kubernetes_only(exported: dict[str, Path], tmp_path: Path,
                                                     capsys) -> None:
    archive = exported["cpu"] / "model-store" / "tiny-cpu"
    assert main(["export", "--target", "kubernetes", str(archive), str(tmp_path / "plain")]) == 0
    assert not list((tmp_path / "plain").glob("*monitor*"))
    assert main(["export", "--target", "kserve", str(archive), str(tmp_path / "k"),
                 "--monitoring"]) == 2
    assert "--target kubernetes" in capsys.readouterr().err
