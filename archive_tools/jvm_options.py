"""The TorchServe frontend's JVM options and the memory to give it: one place for both.

Without options the JVM sizes itself from the machine: its heap grows up to a quarter of
RAM, and metaspace, the JIT's code cache, NIO direct buffers (Netty's pooled arenas: with
no -XX:MaxDirectMemorySize the limit is the heap's maximum) and thread stacks grow on
their own. In a container that is memory the pod was never given, so a long-running pod
can be OOM-killed by growth the JVM was allowed. Every region that can grow gets a bound
here, and `FrontendMemory.budget_mib` adds them up (plus what the JVM has outside them) so
the Kubernetes export can request what the frontend can really use.

TorchServe 0.12 passes config.properties' `vmargs=` to `java` split on whitespace
(ts/model_server.py: start()); with no `vmargs` it passes none at all.

Sizes come from bench/soak.py with these very flags and native memory tracking
(bench/results/SOAK.md, committed MB after the 100k soak's warm-up): live heap after a
full GC ~28, GC structures ~46, metaspace ~21, code ~11, direct buffers ~33 (two Netty
arenas' first chunks), threads, symbols and shared classes ~20.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: the heap the frontend gets unless told otherwise: ~8x the live heap the soak measured,
#: room for bursts of queued requests (each holds its body until a worker takes it)
DEFAULT_HEAP_MIB = 256
#: smallest heap accepted: below it TorchServe's start-up alone (model snapshot, archive
#: unpacking) runs the heap full
MIN_HEAP_MIB = 64
#: loaded classes (TorchServe, Netty, gRPC, log4j2), class space included: the soak
#: measured ~24 MiB committed. Running out exits the JVM (ExitOnOutOfMemoryError), so 4x.
METASPACE_MIB = 96
#: JIT-compiled code: the soak measured ~11 MiB; the JVM's default reserve is 240 MiB.
#: A full code cache stops the JIT (slower, not a crash); 6x.
CODE_CACHE_MIB = 64
#: NIO direct buffers (Netty's pooled direct arenas, 16 MiB chunks). Netty 4.1.53 sizes its
#: arena count from this limit (io.netty.util.internal.PlatformDependent reads
#: -XX:MaxDirectMemorySize; arenas = limit / chunk / 6): 192 MiB keeps two arenas.
#: On Java 17 Netty cannot use its "no cleaner" buffers (reflection is closed), so the
#: JDK's limit is the one that counts and -Dio.netty.maxDirectMemory is not needed.
DIRECT_MIB = 192
#: what the JVM holds outside those regions and G1's structures: thread stacks, symbols,
#: shared classes (CDS), the JIT's arenas while it compiles (NMT "Arena Chunk": up to ~35
#: MiB, given back after), malloc's slack. The soak measured ~55 MiB with 2 CPUs; more CPUs
#: mean more threads, hence the headroom (and `cpus` where the node is larger than the pod).
OVERHEAD_MIB = 128
#: G1's own structures (mark bitmaps, card table, remembered sets) as a share of the heap:
#: NMT's "GC" category measured 46 MiB for a 256 MiB heap
GC_SHARE = 0.25


@dataclass(frozen=True)
class FrontendMemory:
    """Bounds of every region of the frontend JVM that grows, in MiB."""

    heap_mib: int = DEFAULT_HEAP_MIB
    metaspace_mib: int = METASPACE_MIB
    code_cache_mib: int = CODE_CACHE_MIB
    direct_mib: int = DIRECT_MIB
    overhead_mib: int = OVERHEAD_MIB
    #: -XX:ActiveProcessorCount: the CPUs the JVM sizes its thread pools (Netty event loops,
    #: GC and JIT threads) for; None = what it sees. A pod without a CPU limit sees the
    #: whole node (192 vCPUs on inf2.48xlarge), and each thread costs stack and malloc memory
    cpus: int | None = None

    def __post_init__(self) -> None:
        if self.heap_mib < MIN_HEAP_MIB:
            raise ValueError(f"frontend heap {self.heap_mib} MiB: at least {MIN_HEAP_MIB} MiB")
        if self.cpus is not None and self.cpus < 1:
            raise ValueError(f"frontend CPUs {self.cpus}: at least 1")

    def flags(self, *, native_memory_tracking: bool = False) -> list[str]:
        """The `java` options. Native memory tracking (what `jcmd PID VM.native_memory`
        reads) is for measuring: it costs a header on every malloc, and the images ship a
        JRE without jcmd to read it."""
        out = [
            # fixed and touched at start: the heap's RSS is there from the first minute,
            # so what grows later is outside it (and a pod that cannot have it fails now)
            f"-Xms{self.heap_mib}m", f"-Xmx{self.heap_mib}m", "-XX:+AlwaysPreTouch",
            # the collector the soak measured: with under 2 CPUs or 1792 MB (a small
            # container) the JVM would pick the serial one on its own
            "-XX:+UseG1GC",
            f"-XX:MaxMetaspaceSize={self.metaspace_mib}m",
            f"-XX:ReservedCodeCacheSize={self.code_cache_mib}m",
            f"-XX:MaxDirectMemorySize={self.direct_mib}m",
            # a JVM out of heap or metaspace exits (the pod restarts) instead of limping on
            "-XX:+ExitOnOutOfMemoryError",
        ]
        if self.cpus is not None:
            out.append(f"-XX:ActiveProcessorCount={self.cpus}")
        if native_memory_tracking:
            out.append("-XX:NativeMemoryTracking=summary")
        return out

    def vmargs(self, *, native_memory_tracking: bool = False) -> str:
        """config.properties' `vmargs` value."""
        return " ".join(self.flags(native_memory_tracking=native_memory_tracking))

    @property
    def budget_mib(self) -> int:
        """The most RSS the frontend can reach: every bound, G1's share of the heap and the
        rest the JVM holds outside them. What a container needs for the frontend."""
        gc = math.ceil(self.heap_mib * GC_SHARE)
        return (self.heap_mib + gc + self.metaspace_mib + self.code_cache_mib
                + self.direct_mib + self.overhead_mib)


def merge_vmargs(ours: str, theirs: str | None) -> str:
    """`vmargs` with a caller's own after ours: HotSpot takes the last of a repeated option,
    so a caller's -Xmx or -XX:MaxDirectMemorySize wins and the bounds it does not set stay."""
    return f"{ours} {theirs.strip()}" if theirs and theirs.strip() else ours
