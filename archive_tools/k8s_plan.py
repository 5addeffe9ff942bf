"""What one Kubernetes pod of an archive needs: devices, host memory, CPU, /dev/shm, nodes.

Pure sizing for `inf2serve export --target kubernetes`, from the same arithmetic as
`inf2serve validate` (archive_tools.neuron_sizing, archive_tools.nxdi_sizing), so a
pod requests what `validate` estimates and nothing the two disagree on, with one
difference: validate keeps a round HOST_RESERVED_GIB of a host for the OS and the frontend,
while a pod gets the frontend's bounded budget instead (archive_tools/jvm_options.py: the
JVM's heap, metaspace, code cache and direct buffers are capped by its `vmargs`, so what it
can grow to is known) plus the `torchserve` launcher and the probes. The OS is the node's.

Device resources are the Neuron device plugin's: `aws.amazon.com/neuroncore` (one
NeuronCore) or `aws.amazon.com/neuron` (a whole device, all its cores)
(aws-neuron/aws-neuron-sdk@81ce03ae:deploy/includes/k8s-neuron-device-plugin.rst:3-6).
A pod asks for `tp_degree x maxWorkers` NeuronCores; the plugin passes the allocated
devices and cores (NEURON_RT_VISIBLE_CORES) to the container (deploy/infrastructure/
scheduler-flow.rst:45, 58-60), from which each worker claims its block
(handlers/backends/neuron_cores.py). Cores must be
contiguous, which only the Neuron scheduler extension guarantees (deploy/faq.rst:55-59).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from archive_tools import nxdi_sizing
from archive_tools.inspect_cmd import Snapshot
from archive_tools.jvm_options import DEFAULT_HEAP_MIB, FrontendMemory
from archive_tools.neuron_sizing import (
    GIB,
    HOST_RESERVED_GIB,
    INSTANCES,
    WORKER_PROCESS_GIB,
    Arch,
    host_memory,
    token_buckets,
)
from archive_tools.validate_cmd import (
    ARCHITECTURES,
    CHECKPOINT_FORMATS,
    Weights,
    arch_from_config_json,
    validate,
)
from handlers.config import ModelConfig
from handlers.errors import ConfigError
from neuron_cache.key import context_buckets

NEURONCORE = "aws.amazon.com/neuroncore"
NVIDIA_GPU = "nvidia.com/gpu"
#: the JVM, unpacking a .mar and the first worker's handshake, before startupTimeout counts
FRONTEND_START_S = 120
#: what kubelet, the OS and DaemonSets keep of a node's memory (EKS reserves about 5-10%)
ALLOCATABLE = 0.9
#: headroom of the memory limit over the request: the estimates are not measurements
LIMIT_FACTOR = 1.25
#: /dev/shm: container runtimes give 64 MiB. Our runtime passes tensors through pipes, not
#: shared memory; the Neuron runtime keeps a small datastore there (aws-neuron-sdk@81ce03ae:
#: neuron-runtime/api/neuron_ds.rst:6) and AWS's pod examples mount an unsized Memory emptyDir
#: (deploy/eks/dra.rst:58-64). A bound, counted against the memory limit only as used:
SHM_GIB_PER_WORKER = 1
#: the `torchserve --foreground` Python launcher (~30 MiB) and the exec probes (~10 MiB each,
#: three may overlap), next to the frontend in the container
LAUNCHER_MIB = 64


@dataclass(frozen=True)
class PodPlan:
    accelerator: str  # "neuron" | "gpu" | "cpu"
    device_resource: str | None  # extended resource the device plugin advertises
    devices: int  # of device_resource per pod (0 for cpu)
    memory_gib: float  # validate's host-memory estimate (workers + the host's reserve)
    memory_source: str  # which estimate, for the manifest comment and the README
    cpu: int
    shm_gib: int
    instances: tuple[str, ...]  # node instance types the pod may run on; () = any
    startup_s: int  # startup-probe budget
    cache_warm: bool
    warnings: tuple[str, ...] = field(default=())
    #: the frontend JVM's bounds (its config.properties `vmargs`) and so its budget
    frontend: FrontendMemory = field(default_factory=FrontendMemory)

    @property
    def workers_gib(self) -> float:
        """validate's estimate less the host reserve it keeps for the OS and the frontend."""
        return max(0.0, self.memory_gib - HOST_RESERVED_GIB)

    @property
    def frontend_mi(self) -> int:
        """The frontend's bounded budget and the launcher and probes beside it: a bound,
        not an estimate, so the same in the request and the limit."""
        return self.frontend.budget_mib + LAUNCHER_MIB

    @property
    def memory_mi(self) -> int:
        return math.ceil(self.workers_gib * 1024) + self.frontend_mi

    @property
    def memory_limit_mi(self) -> int:
        return (math.ceil(self.workers_gib * LIMIT_FACTOR * 1024) + self.frontend_mi
                + self.shm_gib * 1024)


def accelerator(cfg: ModelConfig) -> str:
    h = cfg.handler
    if h.backend in ("neuron", "nxdi"):
        return "neuron"
    if h.backend == "torch" and (h.device == "cuda" or cfg.frontend.device_type == "gpu"):
        return "gpu"
    return "cpu"


def neuron_host_gib(cfg: ModelConfig, arch: Arch, weights: Weights, cache_warm: bool
                    ) -> tuple[float, str]:
    """validate's host-memory estimate for this pod: loading, or compiling when the cache is
    cold (check_host_memory / validate_nxdi in archive_tools/validate_cmd.py)."""
    h, n, workers = cfg.handler, cfg.handler.neuron, cfg.frontend.max_workers
    if h.backend == "nxdi":  # nxdi: validate estimates loading only
        return nxdi_sizing.host_load_gib(arch, h.amp, workers), "loading (nxdi)"
    graphs = len(token_buckets(h.max_length)) + len(context_buckets(h))
    mem = host_memory(arch, h.amp, workers, graphs, n.compilation_worker_count, weights.fmt,
                      weights.largest_file)
    if cache_warm or mem.load_gib >= mem.compile_gib:
        return mem.load_gib, "loading"
    return mem.compile_gib, "compiling (cold cache)"


def torch_host_gib(cfg: ModelConfig, checkpoint_bytes: int) -> float:
    """Each torch worker holds the weights as stored, plus the process and the frontend."""
    return (cfg.frontend.max_workers * (WORKER_PROCESS_GIB + checkpoint_bytes / GIB)
            + HOST_RESERVED_GIB)


def fitting_instances(devices: int, memory_gib: float) -> tuple[str, ...]:
    """Inf2 sizes with the cores and, allowing for what the node keeps, the memory."""
    return tuple(name for name, i in INSTANCES.items()
                 if i.cores >= devices and i.host_gib * ALLOCATABLE >= memory_gib)


def plan_pod(cfg: ModelConfig, *, arch: Arch | None = None, weights: Weights | None = None,
             checkpoint_bytes: int = 0, instance: str | None = None,
             cache_warm: bool = False, frontend_heap_mib: int = DEFAULT_HEAP_MIB) -> PodPlan:
    """Size one pod; ConfigError when `validate` finds a problem or nothing can host it.
    The frontend JVM sizes its threads for the pod's CPUs, not the node's (no CPU limit, so
    it would see them all), which keeps its budget the same on any node."""
    kind, h, fe = accelerator(cfg), cfg.handler, cfg.frontend
    workers = fe.max_workers
    startup = fe.startup_timeout + FRONTEND_START_S
    shm = SHM_GIB_PER_WORKER * workers
    if kind != "neuron":  # torch (or synthetic): the GPU plugin's resource, or none
        gpu = kind == "gpu"
        cpu = 1 + workers * (1 if gpu else h.threads or 1)
        return PodPlan(
            kind, NVIDIA_GPU if gpu else None, workers if gpu else 0,
            torch_host_gib(cfg, checkpoint_bytes), "weights as stored",
            cpu=cpu, shm_gib=shm, instances=(instance,) if instance else (), startup_s=startup,
            cache_warm=cache_warm, frontend=_frontend(frontend_heap_mib, cpu))
    n = h.neuron
    if arch is None:
        raise ConfigError("handler.neuron.architecture: unset and the archive has no config.json; "
                          "the pod's host memory cannot be estimated")
    if n.cores_per_instance:
        raise ConfigError(f"handler.neuron.cores_per_instance {n.cores_per_instance}: in a pod the "
                          "device plugin hands out NeuronCores (NEURON_RT_VISIBLE_CORES); set it "
                          "to 0 (detect)")
    devices = n.tp_degree * workers
    memory, source = neuron_host_gib(cfg, arch, weights or Weights(), cache_warm)
    fits = fitting_instances(devices, memory + shm)
    if instance is None and not fits:
        raise ConfigError(f"no Inf2 instance hosts {devices} NeuronCores and {memory:.1f} GiB "
                          "host memory; lower maxWorkers or tp_degree")
    report = validate(cfg, arch, instance or fits[0], weights=weights)
    if report.problems:
        raise ConfigError(f"validate: {report.problems[0]}")
    warnings = list(report.warnings)
    if instance and instance not in fits:
        warnings.append(f"--instance {instance}: the pod requests {devices} NeuronCores and "
                        f"{memory:.1f} GiB, more than the node can allocate; it will stay "
                        f"Pending (fits: {', '.join(fits) or 'none'})")
    if not cache_warm:
        warnings.append("the archive's compile cache is empty: every pod compiles at every "
                        f"start (startupTimeout {fe.startup_timeout} s); run `inf2serve compile` "
                        "on an Inf2 host before exporting")
    return PodPlan("neuron", NEURONCORE, devices, memory, source, cpu=1 + workers, shm_gib=shm,
                   instances=(instance,) if instance else fits, startup_s=startup,
                   cache_warm=cache_warm, warnings=tuple(warnings),
                   frontend=_frontend(frontend_heap_mib, 1 + workers))


def _frontend(heap_mib: int, cpus: int) -> FrontendMemory:
    """The frontend's bounds for a pod of `cpus` CPUs; ConfigError for a heap too small."""
    try:
        return FrontendMemory(heap_mib=heap_mib, cpus=cpus)
    except ValueError as exc:
        raise ConfigError(f"--frontend-heap-mb {heap_mib}: {exc}") from exc


def plan_archive(snap: Snapshot, cfg: ModelConfig, cache_entries: int,
                 instance: str | None, frontend_heap_mib: int = DEFAULT_HEAP_MIB) -> PodPlan:
    """plan_pod for a scanned archive: its checkpoint's config.json and weight files."""
    ckpt = cfg.handler.checkpoint.rstrip("/")
    arch = None
    if f"{ckpt}/config.json" in snap.files and accelerator(cfg) == "neuron":
        arch = arch_from_config_json(json.loads(snap.files[f"{ckpt}/config.json"]))
    elif cfg.handler.neuron.architecture in ARCHITECTURES:
        arch = ARCHITECTURES[cfg.handler.neuron.architecture]
    names = {n[len(ckpt) + 1:]: s for n, s in snap.sizes.items() if n.startswith(f"{ckpt}/")}
    weights = Weights()
    for fmt in CHECKPOINT_FORMATS:  # the first format the real loader would pick
        key = fmt.rstrip("/")
        if key in names or (fmt.endswith("/") and any(n.startswith(fmt) for n in names)):
            sizes = [s for n, s in names.items() if "/" not in n
                     and n.endswith((".bin", ".safetensors"))]
            weights = Weights(key, max(sizes, default=0))
            break
    return plan_pod(cfg, arch=arch, weights=weights, checkpoint_bytes=sum(names.values()),
                    instance=instance, cache_warm=cache_entries > 0,
                    frontend_heap_mib=frontend_heap_mib)
