"""Whether a model fits the machine's memory, asked before its weights are laid out.

A model too large for the machine is refused with both figures (what it needs,
what is available) before anything large is allocated, rather than killed by
the kernel's OOM killer halfway through a load.  Available memory is Linux's
``MemAvailable`` (``/proc/meminfo``), lowered to what the process's cgroup (v2)
still allows where it has a limit; where neither can be read the check passes.
"""

from __future__ import annotations

from pathlib import Path

from .errors import ModelLoadError

GiB = 2**30


class InsufficientMemoryError(ModelLoadError):
    """A model (weights and KV cache) needs more memory than the machine has available."""


def available_bytes() -> int | None:
    """Bytes this process can still allocate without swapping, or ``None`` if unknown."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    available = None
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    if available is None:
        return None
    limit = _cgroup_room()
    return available if limit is None else min(available, limit)


def _cgroup_room() -> int | None:
    """``memory.max - memory.current`` of this process's cgroup (v2), ``None`` if unlimited."""
    try:
        line = Path("/proc/self/cgroup").read_text().splitlines()[0]
        group = Path("/sys/fs/cgroup") / line.split("::", 1)[1].lstrip("/")
        limit = (group / "memory.max").read_text().strip()
        current = int((group / "memory.current").read_text())
    except (OSError, IndexError, ValueError):
        return None
    if limit == "max":
        return None
    return max(0, int(limit) - current)


def check_fits(what: str, weight_bytes: int, kv_bytes: int = 0) -> None:
    """Refuses ``what`` (a model's name) if its weights and KV cache, not yet
    allocated, need more than :func:`available_bytes`.

    Raises:
        InsufficientMemoryError: With both figures in the message.
    """
    available = available_bytes()
    needed = weight_bytes + kv_bytes
    if available is None or needed <= available:
        return
    parts = f"{weight_bytes / GiB:.2f} GiB of weights"
    if kv_bytes:
        parts += f" and {kv_bytes / GiB:.2f} GiB of KV cache"
    raise InsufficientMemoryError(
        f"{what} needs {needed / GiB:.2f} GiB ({parts}) but {available / GiB:.2f} GiB of "
        "memory is available: ask for a smaller KV cache (fewer or shorter sequences, a "
        "narrower --kv-cache-format) or free memory"
    )
