"""A request that ends stops generating everywhere: on the API server and in the
model worker.

MAX 26.7 leaves two ways for a request's sequences to go on generating after
its answer went out (each holding the pages of up to ``--max-length`` tokens,
and the batch's compute, for nothing):

* **Sibling prompts** (API server).  A completions request with several
  prompts runs each in its own task (``asyncio.gather``); when one fails (a
  prompt too long, or empty) the request is answered with a 400 at once,
  and the others run on to their last token.  The same holds for the choices
  of a request with ``n`` or ``best_of`` (:mod:`~maxkv.serving.pipelines.
  choices`).  maxkv's tokenizer records the task of every prompt it makes a
  context for (:func:`track_prompt`); the routes run inside
  :func:`prompts_end_with_request`, which cancels those still running when
  the route returns or fails (MAX's response stream then tells the worker).
* **A cancel that overtakes its request** (model worker).  The scheduler reads
  the cancels that came in after each batch and drops one whose request it
  has not received yet: a request put on the request queue during the batch,
  and cancelled during it too, is then received next batch and run to the
  end.  maxkv's scheduler remembers the last :data:`REMEMBERED_CANCELS`
  cancels and drops a request one of them names as it is received
  (:func:`remember_cancels`), as MAX's one-shot scheduler does.  Request ids
  are made by the server (one UUID per HTTP request), never reused.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any

from ... import seams

__all__ = [
    "REMEMBERED_CANCELS",
    "CancelMemory",
    "prompts_end_with_request",
    "remember_cancels",
    "track_prompt",
]

#: How many cancels the model worker remembers (as MAX's one-shot scheduler does):
#: far more than can be on their way at once.
REMEMBERED_CANCELS = 1024

#: The tasks that made a prompt's context for the HTTP request being answered.
_prompt_tasks: ContextVar[set[asyncio.Task[Any]] | None] = ContextVar(
    "maxkv_prompt_tasks", default=None
)


def track_prompt() -> None:
    """Records the running task as one of the current request's prompts (the
    tokenizer calls it as it makes each prompt's context)."""
    tasks = _prompt_tasks.get()
    task = asyncio.current_task()
    if tasks is not None and task is not None:
        tasks.add(task)


@asynccontextmanager
async def prompts_end_with_request() -> AsyncIterator[None]:
    """Around a route answering one HTTP request: on the way out (answered, failed,
    or the client gone) the prompts of the request whose task still runs are
    cancelled (a streamed answer's prompt runs in the route's own task, which
    is left alone)."""
    tasks: set[asyncio.Task[Any]] = set()
    token = _prompt_tasks.set(tasks)
    try:
        yield
    finally:
        _prompt_tasks.reset(token)
        current = asyncio.current_task()
        running = [t for t in tasks if t is not current and not t.done()]
        for task in running:
            task.cancel()
        if running:  # (each tells the worker as it ends)
            await asyncio.wait(running, timeout=5.0)


class CancelMemory:
    """The last ``size`` cancels a model worker received, each until its request
    arrives (one whose request had arrived is pushed out by newer ones).

    Args:
        size: How many cancels are kept.
    """

    def __init__(self, size: int = REMEMBERED_CANCELS) -> None:
        self.size = size
        self._ids: dict[Any, None] = {}

    def remember(self, request_ids: Iterable[Any]) -> None:
        """Keeps the cancels just received (the oldest go beyond ``size``)."""
        for request_id in request_ids:
            self._ids[request_id] = None
        while len(self._ids) > self.size:
            del self._ids[next(iter(self._ids))]

    def take(self, request_id: Any) -> bool:
        """Whether the request arriving now was cancelled (then forgets it)."""
        if request_id not in self._ids:
            return False
        del self._ids[request_id]
        return True

    def __len__(self) -> int:
        return len(self._ids)


def remember_cancels() -> None:
    """Makes MAX's text-generation scheduler drop a request whose cancel came
    before it (once per process): each cancel drained is remembered
    (:class:`CancelMemory`), and a request drained from the request queue
    that one names is dropped before it reaches the batch."""
    drain_cancels = seams.CANCELLED_REQUESTS.resolve()
    if getattr(drain_cancels, "_maxkv_remembers", False):
        return
    drain_requests = seams.PENDING_REQUESTS.resolve()
    memory = CancelMemory()

    @functools.wraps(drain_cancels)
    def cancelled_requests(cancel_queue: Any) -> list[Any]:
        cancelled: list[Any] = drain_cancels(cancel_queue)
        memory.remember(cancelled)
        return cancelled

    @functools.wraps(drain_requests)
    def pending_requests(request_queue: Any, max_items: int | None = None) -> list[Any]:
        drained = drain_requests(request_queue, max_items=max_items)
        return [c for c in drained if not memory.take(getattr(c, "request_id", None))]

    cancelled_requests._maxkv_remembers = True  # type: ignore[attr-defined]
    seams.CANCELLED_REQUESTS.replace(cancelled_requests)
    seams.PENDING_REQUESTS.replace(pending_requests)
