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
