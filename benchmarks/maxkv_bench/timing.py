"""Timing helpers: warm-up, repeats, medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], *, warmup: int, repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def interleaved_median_seconds(
    fns: dict[str, Callable[[], object]], *, warmup: int, repeats: int
) -> dict[str, float]:
    """Median wall time of each of ``fns``, measured in turns.

    After ``warmup`` runs of each, every repeat runs each function once in
    turn, so a slow spell of a shared machine falls on all of them alike.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}
