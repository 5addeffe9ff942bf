"""archive_tools/jvm_options.py: every region of the frontend JVM that grows has a bound, and the
budget the Kubernetes export requests is the sum of those bounds."""

from __future__ import annotations

import pytest

from archive_tools import jvm_options
from archive_tools.jvm_options import FrontendMemory, merge_vmargs


def _flag(flags: list[str], prefix: str) -> str:
    (found,) = [f for f in flags if f.startswith(prefix)]
    return found


def test_every_growing_region_is_bounded() -> None:
    flags = FrontendMemory().flags()
    heap = jvm_options.DEFAULT_HEAP_MIB
    assert _flag(flags, "-Xms") == f"-Xms{heap}m" and _flag(flags, "-Xmx") == f"-Xmx{heap}m"
    assert "-XX:+AlwaysPreTouch" in flags and "-XX:+ExitOnOutOfMemoryError" in flags
    for option in ("-XX:MaxMetaspaceSize=", "-XX:ReservedCodeCacheSize=",
                   "-XX:MaxDirectMemorySize="):
        assert _flag(flags, option).endswith("m")
    # measuring only, and not pinned to CPUs unless asked
    assert not [f for f in flags if "NativeMemoryTracking" in f or "ActiveProcessor" in f]


def test_native_memory_tracking_and_cpus_on_request() -> None:
    flags = FrontendMemory(cpus=3).flags(native_memory_tracking=True)
    assert flags[-2:] == ["-XX:ActiveProcessorCount=3", "-XX:NativeMemoryTracking=summary"]


def test_budget_is_every_bound_plus_what_lies_outside_them() -> None:
    small, large = FrontendMemory(heap_mib=256), FrontendMemory(heap_mib=1024)
    assert small.budget_mib == (256 + 64 + small.metaspace_mib + small.code_cache_mib
                                + small.direct_mib + small.overhead_mib)
    # G1's structures grow with the heap: a larger heap costs more than itself
    assert large.budget_mib - small.budget_mib == 768 + 192


def test_vmargs_is_one_line_of_the_flags() -> None:
    f = FrontendMemory(heap_mib=512)
    assert f.vmargs() == " ".join(f.flags()) and "\n" not in f.vmargs()


@pytest.mark.parametrize("kwargs", [{"heap_mib": 32}, {"cpus": 0}])
def test_too_small_is_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="at least"):
        FrontendMemory(**kwargs)


def test_a_callers_vmargs_go_last_so_they_win() -> None:
    ours = FrontendMemory().vmargs()
    assert merge_vmargs(ours, None) == ours and merge_vmargs(ours, "  ") == ours
    merged = merge_vmargs(ours, "-Xmx1g -Dfoo=bar")
    assert merged.startswith(ours) and merged.endswith(" -Xmx1g -Dfoo=bar")
