"""What this host's CPU can run: its feature flags, read once."""

from __future__ import annotations

import functools
import os


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This host's CPU feature flags from ``/proc/cpuinfo`` (empty where unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has
    one, else every core)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def int8_dot_products() -> str | None:
    """The instructions the int8 kernels multiply with on this host, as the
    Mojo kernels choose them at compile time: ``"AVX-512 VNNI"`` (VPDPBUSD,
    four byte products into each int32 lane) on CPUs with AVX-512 and VNNI,
    ``"AVX2"`` (VPMADDUBSW then VPMADDWD) on those with AVX2 only, else ``None``."""
    flags = cpu_flags()
    if "avx512f" in flags and flags & {"avx512_vnni", "avx_vnni"}:
        return "AVX-512 VNNI"
    if "avx2" in flags:
        return "AVX2"
    return None
