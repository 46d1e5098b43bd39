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
  end.  maxkv's scheduler remembers every cancel for
  :data:`CANCEL_MEMORY_S` seconds (:func:`remember_cancels`), so the
  request is released by the batch after the one that receives it.  Request
  ids are made by the server (one UUID per HTTP request), never reused.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any

from ... import seams

__all__ = [
    "CANCEL_MEMORY_S",
    "CancelMemory",
    "prompts_end_with_request",
    "remember_cancels",
    "track_prompt",
]

#: How long the model worker remembers a cancel, in seconds: far longer than a
#: request takes from the API server to the worker.
CANCEL_MEMORY_S = 60.0

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
    """The cancels a model worker received in the last ``seconds``.

    Args:
        seconds: How long each cancel is remembered.
        clock: Monotonic seconds (``time.monotonic``; tests pass their own).
    """

    def __init__(
        self, seconds: float = CANCEL_MEMORY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.seconds = seconds
        self.clock = clock
        self._until: dict[Any, float] = {}

    def __call__(self, fresh: Iterable[Any]) -> list[Any]:
        """Every cancel remembered now, ``fresh`` (just received) included, oldest first."""
        now = self.clock()
        for request_id in fresh:
            self._until.pop(request_id, None)
            self._until[request_id] = now + self.seconds
        for request_id in [r for r, until in self._until.items() if until <= now]:
            del self._until[request_id]
        return list(self._until)


def remember_cancels() -> None:
    """Makes MAX's text-generation scheduler apply each cancel for
    :data:`CANCEL_MEMORY_S` seconds instead of once (once per process)."""
    drain = seams.CANCELLED_REQUESTS.resolve()
    if getattr(drain, "_maxkv_remembers", False):
        return
    memory = CancelMemory()

    @functools.wraps(drain)
    def cancelled_requests(cancel_queue: Any) -> list[Any]:
        return memory(drain(cancel_queue))

    cancelled_requests._maxkv_remembers = True  # type: ignore[attr-defined]
    seams.CANCELLED_REQUESTS.replace(cancelled_requests)
