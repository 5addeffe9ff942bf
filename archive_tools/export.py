"""`inf2serve export`: lay an archive out the way a managed platform loads it.

sagemaker: an uncompressed model-data folder for an S3 prefix (ModelDataSource,
CompressionType None), which SageMaker downloads to /opt/ml/model:
    config.properties   TorchServe config: /ping and /invocations on 8080, one model
    serve               entry point: starts TorchServe in the foreground from a
                        writable work dir (/opt/ml/model is read-only)
    <archive>           the archive as packaged (a no-archive folder loads fastest)
TorchServe answers SageMaker's /ping and /invocations itself (one startup model),
so the stock TorchServe / Neuron DLC image only needs `serve` as its entry point.
The SageMaker PyTorch toolkit's default `serve` is not used: it re-archives
/opt/ml/model into a .mar with its own handler (every weight copied again, no
streaming).

kserve: the layout KServe's TorchServe runtime mounts at /mnt/models:
    config/config.properties   (model_snapshot names the archive)
    model-store/<archive>

kubernetes: manifests for EKS (or any cluster) running stock TorchServe from a model
image that holds model-store/ (archive_tools/k8s_export.py says what each object does).

All three disable TorchServe's token auth: the platform authenticates callers (IAM,
the cluster's ingress) and only it can reach the container's port. All three bound the
frontend JVM's memory through config.properties' `vmargs` (archive_tools/jvm_options.py;
`--frontend-heap-mb` sizes its heap), as `inf2serve serve` does.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from archive_tools.fileops import copy_path, human, progress_bar, staged
from archive_tools.inspect_cmd import scan, summarize
from archive_tools.jvm_options import DEFAULT_HEAP_MIB, FrontendMemory
from archive_tools.k8s_export import K8sOptions, next_steps_k8s, write_manifests
from archive_tools.k8s_plan import plan_archive
from handlers.config import parse_config
from handlers.errors import Inf2ServeError

TARGETS = ("sagemaker", "kserve", "kubernetes")
SERVE_SCRIPT = """#!/bin/sh
# SageMaker starts the container with the argument `serve`; run TorchServe in the foreground.
set -e
MODEL_DIR="${{SM_MODEL_DIR:-/opt/ml/model}}"
PORT="${{SAGEMAKER_BIND_TO_PORT:-8080}}"
WORK="$(mktemp -d)"  # /opt/ml/model is read-only: logs, pid and snapshots go here
cd "$WORK"
export LOG_LOCATION="$WORK/logs" METRICS_LOCATION="$WORK/logs"
sed "s#^inference_address=.*#inference_address=http://0.0.0.0:$PORT#" \\
    "$MODEL_DIR/config.properties" > config.properties
exec torchserve --start --foreground --ncs --ts-config config.properties \\
    --model-store "$MODEL_DIR" --models {spec}
"""


def _props(props: dict[str, str]) -> str:
    return "".join(f"{k}={v}\n" for k, v in props.items())


def sagemaker_properties(name: str, archive: str, cfg: dict,
                         frontend: FrontendMemory | None = None) -> str:
    return _props({
        "inference_address": "http://0.0.0.0:8080",
        "management_address": "http://127.0.0.1:8081",
        "metrics_address": "http://127.0.0.1:8082",
        "model_store": "/opt/ml/model",
        "load_models": f"{name}={archive}",
        "disable_token_authorization": "true",
        "enable_model_api": "false",
        "install_py_dep_per_model": "false",
        "default_response_timeout": str(cfg["responseTimeout"]),
        "enable_envvars_config": "false",
        "vmargs": (frontend or FrontendMemory()).vmargs(),
    })


def kserve_properties(name: str, archive: str, cfg: dict,
                      frontend: FrontendMemory | None = None) -> str:
    snapshot = {"name": "startup.cfg", "modelCount": 1, "models": {name: {"1.0": {
        "defaultVersion": True, "marName": archive, "minWorkers": cfg["minWorkers"],
        "maxWorkers": cfg["maxWorkers"], "batchSize": cfg["batchSize"],
        "maxBatchDelay": cfg["maxBatchDelay"], "responseTimeout": cfg["responseTimeout"]}}}}
    return _props({
        "inference_address": "http://0.0.0.0:8085",
        "management_address": "http://127.0.0.1:8081",
        "metrics_address": "http://0.0.0.0:8082",
        "grpc_inference_port": "7070",
        "grpc_management_port": "7071",
        "enable_metrics_api": "true",
        "metrics_mode": "prometheus",
        "number_of_netty_threads": "4",
        "job_queue_size": str(cfg["handler"]["max_queue"]),
        "enable_envvars_config": "true",
        "install_py_dep_per_model": "false",
        "disable_token_authorization": "true",
        "model_store": "/mnt/models/model-store",
        "model_snapshot": json.dumps(snapshot, separators=(",", ":")),
        "vmargs": (frontend or FrontendMemory()).vmargs(),
    })


def next_steps(target: str, name: str, out: Path, cfg: dict) -> str:
    neuron = cfg["handler"]["backend"] in ("neuron", "nxdi")
    if target == "sagemaker":
        return f"""next:
  aws s3 sync {out} s3://BUCKET/{name}/
  # image: a TorchServe image with torch + transformers (for neuron: the PyTorch Neuron DLC),
  # entry point /opt/ml/model/serve, e.g. a Dockerfile with:
  #   ENTRYPOINT ["/bin/sh", "/opt/ml/model/serve"]
  aws sagemaker create-model --model-name {name} --execution-role-arn ROLE_ARN \\
    --primary-container '{{"Image": "IMAGE_URI", "ModelDataSource": {{"S3DataSource": {{
      "S3Uri": "s3://BUCKET/{name}/", "S3DataType": "S3Prefix", "CompressionType": "None"}}}}}}'
  # then create-endpoint-config (instance type{' ml.inf2.xlarge' if neuron else ''}) and
  # create-endpoint; stream with invoke-endpoint-with-response-stream"""
    limits = "          aws.amazon.com/neuron: 1\n" if neuron else "          cpu: \"2\"\n"
    return f"""next:
  aws s3 sync {out} s3://BUCKET/{name}/
  kubectl apply -f - <<'EOF'
apiVersion: serving.kserve.io/v1beta1
kind: InferenceService
metadata:
  name: {name}
spec:
  predictor:
    pytorch:
      storageUri: s3://BUCKET/{name}
      resources:
        limits:
{limits}EOF"""


def export(archive: Path, out: Path, target: str, *, force: bool = False, link: bool = False,
           show_progress: bool = False, k8s: K8sOptions | None = None,
           frontend_heap_mib: int = DEFAULT_HEAP_MIB) -> tuple[Path, str]:
    """Write the platform layout to `out` (atomically); returns (out, next steps).
    `frontend_heap_mib` sizes the frontend JVM's fixed heap (its other bounds are fixed)."""
    archive, out = Path(archive), Path(out)
    if target not in TARGETS:
        raise Inf2ServeError(f"--target {target!r}: choose one of {', '.join(TARGETS)}")
    try:
        frontend = FrontendMemory(heap_mib=frontend_heap_mib)
    except ValueError as exc:
        raise Inf2ServeError(f"--frontend-heap-mb {frontend_heap_mib}: {exc}") from exc
    if not archive.exists():
        raise Inf2ServeError(f"ARCHIVE {archive}: no such file or directory")
    snap = scan(archive)
    summary = summarize(snap)  # validates manifest and config first
    name = summary["manifest"]["model"]["modelName"]
    cfg = summary["config"]
    if target == "kubernetes":
        k8s = k8s or K8sOptions()
        plan = plan_archive(snap, parse_config(cfg), len(summary["cache"]), k8s.instance,
                            frontend_heap_mib)
    if out.exists() and not force:
        raise Inf2ServeError(f"OUT {out} exists; pass --force to replace it")
    if archive.resolve() == out.resolve() or out.resolve() in archive.resolve().parents:
        raise Inf2ServeError(f"OUT {out}: must not contain ARCHIVE; pick another directory")
    with staged(out) as built:
        store = built if target == "sagemaker" else built / "model-store"  # kserve, kubernetes
        store.mkdir(parents=True)
        files = [p for p in sorted(archive.rglob("*")) if p.is_file()] if archive.is_dir() \
            else [archive]
        base = archive.parent
        with progress_bar(sum(f.stat().st_size for f in files), f"exporting {name}",
                          show_progress) as advance:
            for f in files:
                dst = store / f.relative_to(base)
                dst.parent.mkdir(parents=True, exist_ok=True)
                copy_path(f, dst, advance, link=link)
        if target == "sagemaker":
            (built / "config.properties").write_text(
                sagemaker_properties(name, archive.name, cfg, frontend))
            serve = built / "serve"
            serve.write_text(SERVE_SCRIPT.format(spec=f"{name}={archive.name}"))
            serve.chmod(0o755)
        elif target == "kubernetes":
            write_manifests(built, name, archive.name, cfg, plan, image=k8s.image_for(name),
                            replicas=k8s.replicas, namespace=k8s.namespace,
                            monitoring=k8s.monitoring,
                            version=str(summary["manifest"]["model"].get("modelVersion", "1.0")))
        else:
            (built / "config").mkdir()
            (built / "config" / "config.properties").write_text(
                kserve_properties(name, archive.name, cfg, frontend))
        for d in [built, *(p for p in built.rglob("*") if p.is_dir())]:
            d.chmod(0o755)
    if target == "kubernetes":
        return out, next_steps_k8s(out, name, cfg, plan, k8s)
    return out, next_steps(target, name, out, cfg)


def _run(args: argparse.Namespace) -> int:
    if args.target != "kubernetes" and (args.image or args.replicas or args.instance
                                        or args.namespace or args.monitoring):
        raise Inf2ServeError("--image, --replicas, --instance, --namespace and --monitoring "
                             "are for --target kubernetes")
    if args.replicas is not None and args.replicas < 1:
        raise Inf2ServeError(f"--replicas {args.replicas}: must be 1 or more")
    k8s = K8sOptions(args.image or "", args.replicas or 1, args.instance,
                     args.namespace or "default", args.monitoring)
    out, steps = export(Path(args.archive), Path(args.out), args.target, force=args.force,
                        link=args.link, show_progress=True, k8s=k8s,
                        frontend_heap_mib=args.frontend_heap_mb)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"exported for {args.target}: {out} ({human(size)})")
    print(steps)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="lay an archive out for SageMaker, KServe or Kubernetes and print the "
        "next step",
        description="Write the folder a platform loads: sagemaker (uncompressed model data for "
        "an S3 prefix: archive + config.properties + serve), kserve (config/config.properties "
        "+ model-store/) or kubernetes (kustomize-ready manifests sized by `validate`, the "
        "model image's Dockerfile + model-store/).\n\nexamples:\n"
        "  inf2serve export --target sagemaker model_store/llama deploy/sagemaker-llama\n"
        "  inf2serve export --target kserve model_store/tiny-llama.mar deploy/kserve-tiny\n"
        "  inf2serve export --target kubernetes model_store/llama deploy/k8s-llama \\\n"
        "      --image ECR/llama:1 --replicas 2 --namespace llm",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, choices=TARGETS,
                   help="where it will run: " + ", ".join(TARGETS))
    p.add_argument("archive", metavar="ARCHIVE", help=".mar, .tar.gz or archive folder")
    p.add_argument("out", metavar="OUT", help="output directory (written atomically)")
    p.add_argument("--link", action="store_true",
                   help="hard-link archive files instead of copying (same filesystem)")
    p.add_argument("--force", action="store_true", help="replace an existing OUT")
    p.add_argument("--frontend-heap-mb", type=int, default=DEFAULT_HEAP_MIB,
                   help="the frontend JVM's heap, fixed and pre-touched (config.properties "
                   f"vmargs; default {DEFAULT_HEAP_MIB}); kubernetes adds the frontend's "
                   "whole budget to the container's memory")
    k = p.add_argument_group("kubernetes")
    k.add_argument("--image", help="model image the Deployment runs (default NAME:0.1.0)")
    k.add_argument("--replicas", type=int, help="replicas, and the HPA's minimum (default 1)")
    k.add_argument("--instance", help="pin pods to one Inf2 size (default: any that fits)")
    k.add_argument("--namespace", help="namespace of every object (default: default)")
    k.add_argument("--monitoring", action="store_true",
                   help="add a PodMonitor for the server (Prometheus operator) and, for a "
                   "Neuron model, AWS's neuron-monitor DaemonSet with its PodMonitor")
    p.set_defaults(func=_run)
