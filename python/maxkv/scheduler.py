"""``maxkv.scheduler``: a short import path for :mod:`maxkv.serving.scheduler`.

``from maxkv.scheduler import ContinuousBatchingScheduler`` and
``from maxkv.serving.scheduler import ContinuousBatchingScheduler`` name the
same class.
"""

from .serving.scheduler import (
    ContinuousBatchingScheduler,
    Request,
    SchedulerStats,
    positions_needed,
)

__all__ = ["ContinuousBatchingScheduler", "Request", "SchedulerStats", "positions_needed"]
