"""`inf2serve export --target kubernetes`: schema-valid manifests that compose, sized by
`validate` for every shipped config, and a probe that reads TorchServe's answers."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from archive_tools import k8s_export
from archive_tools.cli import main
from archive_tools.jvm_options import FrontendMemory
from archive_tools.k8s_plan import LAUNCHER_MIB, NEURONCORE, NVIDIA_GPU, plan_pod
from archive_tools.neuron_sizing import HOST_RESERVED_GIB
from archive_tools.package import package
from archive_tools.validate_cmd import ARCHITECTURES, validate
from handlers.config import load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "model_configs" / "tiny-llama-cpu.yaml"
SHIPPED = sorted((ROOT / "model_configs").rglob("*.yaml"))
K8S_VERSIONS = ("1.30.0", "1.33.0")  # two Kubernetes releases EKS supports; schemas in the wheel
# (kind, accelerator, config edits): the torch CPU demo, the same on GPU nodes, and Neuron
VARIANTS = {
    "cpu": {},
    "gpu": {"deviceType: cpu": "deviceType: gpu"},
    "neuron": {"backend: torch": "backend: neuron", "deviceType: cpu": "deviceType: neuron",
               "minWorkers: 1": "minWorkers: 2", "maxWorkers: 1": "maxWorkers: 2"},
}


@pytest.fixture(scope="module")
def exported(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("k8s")
    out = {}
    for kind, edits in VARIANTS.items():
        text = CONFIG.read_text()
        for old, new in edits.items():
            text = text.replace(old, new)
        (tmp / f"{kind}.yaml").write_text(text)
        archive = package(tmp / f"{kind}.yaml", tiny_checkpoint, f"tiny-{kind}", "no-archive",
                          tmp / "store")
        out[kind] = tmp / f"out-{kind}"
        assert main(["export", "--target", "kubernetes", str(archive), str(out[kind]),
                     "--namespace", "llm", "--replicas", "2", "--image", f"ecr/tiny-{kind}:1"]) == 0
    return out


def resources(out: Path) -> dict[str, dict]:
    """kustomization.yaml's resources, each file holding exactly one object, by kind."""
    kust = yaml.safe_load((out / "kustomization.yaml").read_text())
    objs = {}
    for file in kust["resources"]:
        docs = list(yaml.safe_load_all((out / file).read_text()))
        assert len(docs) == 1, f"{file}: one object per file"
        objs[docs[0]["kind"]] = docs[0]
    return objs


def pod(out: Path) -> dict:
    return resources(out)["Deployment"]["spec"]["template"]["spec"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("kind", list(VARIANTS))
def test_every_manifest_validates_against_the_schemas(exported: dict[str, Path], kind: str,
                                                      version: str) -> None:
    objs = resources(exported[kind])
    assert set(objs) == {"Namespace", "ConfigMap", "Deployment", "Service",
                         "PodDisruptionBudget", "HorizontalPodAutoscaler"}
    for obj in objs.values():
        try:  # strict: an unknown or misspelt field fails too
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']} on {version}: {exc.caught.message} at "
                        f"{list(exc.caught.absolute_path)}")


def test_the_validator_rejects_a_broken_deployment(exported: dict[str, Path]) -> None:
    broken = resources(exported["cpu"])["Deployment"]
    broken["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # typo of resources
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


def test_kustomization_composes(exported: dict[str, Path]) -> None:
    """What `kubectl apply -k` needs: every resource exists and parses (above), names and
    selectors refer to each other, and every object lands in the kustomization's namespace."""
    out = exported["neuron"]
    kust = yaml.safe_load((out / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization" and kust["namespace"] == "llm"
    objs = resources(out)
    dep, svc, pdb, hpa, cm = (objs[k] for k in ("Deployment", "Service", "PodDisruptionBudget",
                                                 "HorizontalPodAutoscaler", "ConfigMap"))
    labels = dep["spec"]["template"]["metadata"]["labels"]
    for selector in (dep["spec"]["selector"]["matchLabels"], svc["spec"]["selector"],
                     pdb["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= labels.items()
    assert hpa["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == cm["metadata"]["name"]
    ports = {p["name"] for c in dep["spec"]["template"]["spec"]["containers"]
             for p in c["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports
    volumes = {v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["name"] for c in dep["spec"]["template"]["spec"]["containers"]
              for m in c["volumeMounts"]}
    assert mounts <= volumes
    for obj in objs.values():
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "llm"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) not installed")
def test_kubectl_kustomize_builds_it(exported: dict[str, Path]) -> None:
    built = subprocess.run(["kubectl", "kustomize", str(exported["neuron"])], check=True,
                           capture_output=True, text=True, timeout=60).stdout
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(built) if d)
    assert kinds == sorted(resources(exported["neuron"]))


def test_torchserve_config_keeps_management_private(exported: dict[str, Path]) -> None:
    props = dict(line.split("=", 1) for line in
                 resources(exported["cpu"])["ConfigMap"]["data"]["config.properties"].splitlines())
    assert props["inference_address"] == "http://0.0.0.0:8080"  # the pod's address: in-cluster
    assert props["management_address"].startswith("http://127.0.0.1:")
    assert props["grpc_management_address"] == props["grpc_inference_address"] == "127.0.0.1"
    assert props["enable_model_api"] == "false"
    assert props["disable_token_authorization"] == "true"  # the platform authenticates
    assert props["model_metrics_auto_detect"] == "true"  # the gauges the HPA reads
    svc = resources(exported["cpu"])["Service"]
    assert svc["spec"]["type"] == "ClusterIP"
    assert {p["port"] for p in svc["spec"]["ports"]} == {8080, 8082, 8090}


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_the_frontend_jvm_is_bounded_and_the_pod_holds_its_budget(
        exported: dict[str, Path], kind: str) -> None:
    """config.properties' vmargs bound every region of the JVM that grows, sized for the
    pod's CPUs (no CPU limit: the JVM would size its threads for the node), and the
    container's memory request and limit carry that budget next to the workers'."""
    objs = resources(exported[kind])
    props = dict(line.split("=", 1) for line in
                 objs["ConfigMap"]["data"]["config.properties"].splitlines())
    c = objs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    frontend = FrontendMemory(cpus=int(c["resources"]["requests"]["cpu"]))
    assert props["vmargs"] == frontend.vmargs()
    assert "-Xms256m" in props["vmargs"] and "-XX:MaxDirectMemorySize=" in props["vmargs"]
    plan = json.loads((exported[kind] / "plan.json").read_text())
    workers_mib = math.ceil(max(0.0, plan["memory_gib"] - HOST_RESERVED_GIB) * 1024)
    request = int(c["resources"]["requests"]["memory"].removesuffix("Mi"))
    limit = int(c["resources"]["limits"]["memory"].removesuffix("Mi"))
    assert request == plan["memory_request_mib"]
    assert abs(request - (workers_mib + frontend.budget_mib + LAUNCHER_MIB)) <= 1
    assert plan["frontend_memory_mib"] == frontend.budget_mib + LAUNCHER_MIB
    assert limit - request >= frontend.budget_mib // 4  # the workers' headroom and /dev/shm
    assert limit == plan["memory_limit_mib"]


def test_frontend_heap_option_sizes_vmargs_and_memory(exported: dict[str, Path],
                                                      tmp_path: Path, capsys) -> None:
    archive = exported["cpu"] / "model-store" / "tiny-cpu"
    out = tmp_path / "big"
    assert main(["export", "--target", "kubernetes", str(archive), str(out),
                 "--frontend-heap-mb", "1024"]) == 0
    big, default = (json.loads((o / "plan.json").read_text()) for o in (out, exported["cpu"]))
    assert "-Xms1024m -Xmx1024m" in big["frontend_vmargs"]
    grown = FrontendMemory(heap_mib=1024).budget_mib - FrontendMemory().budget_mib
    assert big["memory_request_mib"] - default["memory_request_mib"] == grown
    assert main(["export", "--target", "kubernetes", str(archive), str(tmp_path / "small"),
                 "--frontend-heap-mb", "8"]) == 2
    assert "--frontend-heap-mb 8" in capsys.readouterr().err


def test_neuron_pod(exported: dict[str, Path]) -> None:
    spec = pod(exported["neuron"])
    res = spec["containers"][0]["resources"]
    # tp_degree 2 (default) x maxWorkers 2; extended resources: requests == limits
    assert res["requests"][NEURONCORE] == res["limits"][NEURONCORE] == 4
    assert {"key": "aws.amazon.com/neuron", "operator": "Exists",
            "effect": "NoSchedule"} in spec["tolerations"]
    term = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    expr = term["nodeSelectorTerms"][0]["matchExpressions"][0]
    assert expr["key"] == "node.kubernetes.io/instance-type"
    assert expr["values"] == ["inf2.24xlarge", "inf2.48xlarge"]  # 4 cores: not the 2-core sizes
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")["emptyDir"]
    assert shm == {"medium": "Memory", "sizeLimit": "2Gi"}
    plan = json.loads((exported["neuron"] / "plan.json").read_text())
    assert plan["base_image"] == "inf2serve-base:0.1.0-neuron" and not plan["cache_warm"]
    assert (exported["neuron"] / "Dockerfile").read_text().count("FROM ${BASE}") == 1
    assert spec["containers"][0]["image"] == "ecr/tiny-neuron:1"


def test_gpu_and_cpu_pods(exported: dict[str, Path]) -> None:
    gpu = pod(exported["gpu"])
    assert gpu["containers"][0]["resources"]["limits"][NVIDIA_GPU] == 1  # one per worker
    assert [t["key"] for t in gpu["tolerations"]] == ["nvidia.com/gpu"]
    cpu = pod(exported["cpu"])
    assert set(cpu["containers"][0]["resources"]["limits"]) == {"memory"}
    assert "tolerations" not in cpu and "affinity" not in cpu


def test_probes_and_startup_budget(exported: dict[str, Path]) -> None:
    c = pod(exported["neuron"])["containers"][0]
    assert c["livenessProbe"]["exec"]["command"][-1] == "live"
    assert c["readinessProbe"]["exec"]["command"][-2:] == ["ready", "tiny-neuron"]
    start = c["startupProbe"]
    # startupTimeout 600 of the config + the frontend's own start
    assert start["periodSeconds"] * start["failureThreshold"] >= 600 + 120


def test_hpa_reads_the_adapter_metrics(exported: dict[str, Path]) -> None:
    hpa = resources(exported["neuron"])["HorizontalPodAutoscaler"]["spec"]
    assert hpa["minReplicas"] == 2
    names = [m["pods"]["metric"]["name"] for m in hpa["metrics"] if m["type"] == "Pods"]
    assert [m["resource"]["name"] for m in hpa["metrics"] if m["type"] == "Resource"] == ["cpu"]
    rules = yaml.safe_load((exported["neuron"] / "prometheus-adapter-values.yaml").read_text())
    exposed = {r["name"]["as"]: r["seriesQuery"] for r in rules["rules"]["custom"]}
    assert sorted(names) == sorted(exposed)
    # the series are vLLM's load gauges, which the router's /metrics carries
    assert {q.split("{")[0] for q in exposed.values()} == {"vllm:num_requests_waiting",
                                                          "vllm:num_requests_running"}
    annotations = resources(exported["neuron"])["Deployment"]["spec"]["template"]["metadata"]
    assert annotations["annotations"]["prometheus.io/port"] == "8090"  # the router's


def test_the_router_serves_the_pods_metrics_beside_torchserve(exported: dict[str, Path]) -> None:
    """The router reads the files TorchServe's workers write: one emptyDir, mounted by
    both, named to the workers by INF2SERVE_METRICS_DIR; it asks TorchServe on loopback."""
    torchserve, router = pod(exported["neuron"])["containers"]
    env = {e["name"]: e["value"] for e in torchserve["env"]}
    written = env["INF2SERVE_METRICS_DIR"]
    mounts = {c["name"]: {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
              for c in (torchserve, router)}
    assert mounts["torchserve"]["metrics"] == mounts["router"]["metrics"] == written
    args = router["args"]
    assert args[args.index("--metrics-dir") + 1] == written
    assert args[args.index("--metrics-from") + 1] == "torchserve=http://127.0.0.1:8082/metrics"
    assert args[args.index("--model") + 1] == "tiny-neuron=1.0"  # the archive's version
    assert router["command"][:3] == ["python3", "-m", "archive_tools.openai_router"]
    assert router["image"] == torchserve["image"]


def test_options_only_for_kubernetes_and_cores_per_instance(
        exported: dict[str, Path], tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    archive = exported["cpu"] / "model-store" / "tiny-cpu"
    assert main(["export", "--target", "kserve", str(archive), str(tmp_path / "a"),
                 "--replicas", "2"]) == 2
    assert "--target kubernetes" in capsys.readouterr().err
    cfg = tmp_path / "pinned.yaml"
    cfg.write_text(CONFIG.read_text().replace("backend: torch", "backend: neuron")
                   + "  neuron:\n    cores_per_instance: 24\n")
    pinned = package(cfg, tiny_checkpoint, "pinned", "no-archive", tmp_path / "store")
    assert main(["export", "--target", "kubernetes", str(pinned), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "cores_per_instance 24" in err and "set it to 0" in err
    assert not (tmp_path / "b").exists()


def _validate_host_gib(notes: list[str]) -> tuple[float, float | None]:
    """(loading, compiling) GiB from validate's note."""
    for note in notes:
        m = re.search(r"host memory \(estimate\): loading ([\d.]+) GiB(?:, compiling ([\d.]+))?",
                      note)
        if m:
            return float(m.group(1)), float(m.group(2)) if m.group(2) else None
    raise AssertionError(f"no host-memory note in {notes}")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT / "model_configs")))
def test_requests_match_validate_for_every_shipped_config(path: Path) -> None:
    cfg = load_config(path)
    arch = ARCHITECTURES.get(cfg.handler.neuron.architecture)
    for warm in (False, True):
        plan = plan_pod(cfg, arch=arch, cache_warm=warm)
        dep = k8s_export.deployment("m", "ns", "m", "img", 1, plan, "")
        res = dep["spec"]["template"]["spec"]["containers"][0]["resources"]
        if cfg.handler.backend not in ("neuron", "nxdi"):
            assert "backend" in validate(cfg, arch, None).notes[0]  # nothing for validate
            assert set(res["limits"]) <= {"memory", NVIDIA_GPU}
            continue
        n = cfg.handler.neuron
        assert res["requests"][NEURONCORE] == n.tp_degree * cfg.frontend.max_workers
        named = path.stem.split("-")[0]  # the instance the config is written for
        report = validate(cfg, arch, named)
        load, compile_ = _validate_host_gib(report.notes)
        estimate = load if warm or compile_ is None else max(load, compile_)
        # validate's host reserve (OS and frontend) is replaced by the frontend's budget
        frontend = FrontendMemory(cpus=plan.cpu).budget_mib + LAUNCHER_MIB
        expected = estimate - HOST_RESERVED_GIB + frontend / 1024
        requested = int(res["requests"]["memory"].removesuffix("Mi")) / 1024
        assert abs(requested - expected) <= 0.051, (warm, requested, expected)
        if not any(w.startswith("host memory") for w in report.warnings):
            assert named in plan.instances  # schedulable where the config is meant to run


class _FakeTorchServe(BaseHTTPRequestHandler):
    """Answers as TorchServe 0.12 does: /ping, and GET /models/NAME (a list of versions)."""

    ping, workers = 200, [{"status": "LOADING"}]

    def do_GET(self) -> None:  # noqa: N802
        cls = type(self)
        if self.path == "/ping":
            code, body = cls.ping, {"status": "Healthy" if cls.ping == 200 else "Unhealthy"}
        elif self.path == "/models/tiny":
            code, body = 200, [{"modelName": "tiny", "workers": cls.workers}]
        else:
            code, body = 404, {"code": 404}
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


def test_probe_script(monkeypatch) -> None:
    import runpy

    probe = runpy.run_path(str(k8s_export.PROBE))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeTorchServe)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        main_, glb = probe["main"], probe["main"].__globals__
        monkeypatch.setitem(glb, "INFERENCE", url)
        monkeypatch.setitem(glb, "MANAGEMENT", url)
        assert main_(["probe", "live"]) == 0
        assert main_(["probe", "ready", "tiny"]) == 1  # loading: not ready, yet alive
        _FakeTorchServe.workers = [{"status": "LOADING"}, {"status": "READY"}]
        assert main_(["probe", "ready", "tiny"]) == 0
        assert main_(["probe", "ready", "other"]) == 1  # 404
        _FakeTorchServe.ping = 500
        assert main_(["probe", "live"]) == 1
    finally:
        server.shutdown()
        _FakeTorchServe.ping, _FakeTorchServe.workers = 200, [{"status": "LOADING"}]
    monkeypatch.setitem(glb, "INFERENCE", "http://127.0.0.1:1")
    assert main_(["probe", "live"]) == 1  # refused


def test_base_image_profiles_exist_in_the_dockerfile(exported: dict[str, Path]) -> None:
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    profiles = set(re.findall(r"^\s+(\w+)\) pip install", dockerfile, re.M))
    for out in exported.values():
        tag = json.loads((out / "plan.json").read_text())["base_image"]
        assert tag.startswith(f"inf2serve-base:{k8s_export.VERSION}-")
        assert tag.rsplit("-", 1)[1] in profiles, (tag, profiles)
    assert {"neuron", "nxdi", "gpu", "cpu"} <= profiles
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'\nversion = "{k8s_export.VERSION}"\n' in pyproject  # the tag follows the release


def test_a_filled_cache_sizes_for_loading(exported: dict[str, Path], tmp_path: Path,
                                          capsys) -> None:
    archive = tmp_path / "tiny-neuron"
    shutil.copytree(exported["neuron"] / "model-store" / "tiny-neuron", archive)
    entry = archive / "neuron_cache" / "llama-tp2-0123456789ab"  # what neuron_cache writes
    entry.mkdir(parents=True)
    (entry / "metadata.json").write_text(json.dumps({"inputs": {"tp_degree": 2}, "files": {}}))
    cold = json.loads((exported["neuron"] / "plan.json").read_text())
    capsys.readouterr()
    assert main(["export", "--target", "kubernetes", str(archive), str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    warm = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert warm["cache_warm"] and warm["memory_source"] == "loading"
    assert cold["memory_source"] == "compiling (cold cache)"
    assert warm["memory_gib"] < cold["memory_gib"]  # no neuronx-cc processes to hold
    assert "compile cache is empty" not in printed and "x aws.amazon.com/neuroncore" in printed
