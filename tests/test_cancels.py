"""A request that ends stops generating everywhere (:mod:`maxkv.serving.pipelines.cancels`):
its other prompts on the API server, a cancel that overtakes its request in the
model worker.  (Against a real server: ``tests/test_serve_fuzz.py``.)"""

from __future__ import annotations

import asyncio
import queue
from typing import Any

import pytest

pytestmark = pytest.mark.unit


def test_cancels_are_remembered_until_their_request_comes() -> None:
    from maxkv.serving.pipelines.cancels import CancelMemory

    memory = CancelMemory(size=3)
    memory.remember(["a", "b"])
    assert memory.take("a") and not memory.take("a")  # forgotten once its request came
    assert not memory.take("z")
    memory.remember(["c", "d", "e"])  # "b" is the oldest of four: pushed out
    assert len(memory) == 3 and not memory.take("b")
    assert [memory.take(r) for r in "cde"] == [True, True, True] and len(memory) == 0


class _Queue:
    """MAX's pull queue interface (``get_nowait``, ``queue.Empty`` when empty)."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def get_nowait(self) -> Any:
        if not self.items:
            raise queue.Empty
        return self.items.pop(0)


class _Context:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


def test_the_scheduler_drops_a_request_whose_cancel_came_first() -> None:
    from maxkv import seams
    from maxkv.serving.pipelines.cancels import remember_cancels

    def original(seam: seams.Seam) -> Any:
        name = seam.resolve()
        return getattr(name, "__wrapped__", name)  # (maxkv.pipelines wraps them)

    cancels, requests = original(seams.CANCELLED_REQUESTS), original(seams.PENDING_REQUESTS)
    with (
        seams.CANCELLED_REQUESTS.replaced(cancels),
        seams.PENDING_REQUESTS.replaced(requests),
    ):
        remember_cancels()
        remember_cancels()  # (once per process)
        drain_cancels = seams.CANCELLED_REQUESTS.resolve()
        drain_requests = seams.PENDING_REQUESTS.resolve()
        assert drain_cancels.__wrapped__ is cancels and drain_requests.__wrapped__ is requests
        # A batch runs; "x" is cancelled before the worker has received it.
        assert drain_cancels(_Queue([["x"], ["done"]])) == ["x", "done"]  # as MAX's
        arrived = drain_requests(_Queue([_Context("y"), _Context("x"), _Context("z")]))
        assert [c.request_id for c in arrived] == ["y", "z"]  # "x" never reaches the batch
        arrived = drain_requests(_Queue([_Context("a"), _Context("b")]), max_items=1)
        assert [c.request_id for c in arrived] == ["a"]
    assert seams.CANCELLED_REQUESTS.resolve() is not drain_cancels


async def _prompt(seconds: float, fail: bool, ended: list[str], name: str) -> str:
    from maxkv.serving.pipelines.cancels import track_prompt

    track_prompt()
    try:
        await asyncio.sleep(seconds)
        if fail:
            raise ValueError(f"{name} failed")
        return name
    except asyncio.CancelledError:
        ended.append(f"{name} cancelled")
        raise


async def _route(ended: list[str]) -> Any:
    """As MAX's completions route runs a request's prompts: gathered, one failing."""
    return await asyncio.gather(
        _prompt(30.0, False, ended, "long"), _prompt(0.01, True, ended, "bad")
    )


def test_a_failed_request_cancels_its_other_prompts() -> None:
    from maxkv.serving.pipelines.cancels import prompts_end_with_request

    async def main(wrapped: bool) -> list[str]:
        ended: list[str] = []
        with pytest.raises(ValueError, match="bad failed"):
            if wrapped:
                async with prompts_end_with_request():
                    await _route(ended)
            else:
                await _route(ended)
        await asyncio.sleep(0.05)
        still = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in still:  # (the control's orphan)
            task.cancel()
        return [*ended, f"{len(still)} running"]

    # MAX's gather leaves the long prompt running after the request failed:
    assert asyncio.run(main(wrapped=False)) == ["1 running"]
    assert asyncio.run(main(wrapped=True)) == ["long cancelled", "0 running"]


def test_a_streamed_answers_own_prompt_is_left_running() -> None:
    from maxkv.serving.pipelines.cancels import prompts_end_with_request, track_prompt

    async def main() -> bool:
        async with prompts_end_with_request():
            track_prompt()  # a stream's first chunk is made in the route's own task
        return True

    assert asyncio.run(main())


def test_choice_seeds_are_far_apart_in_int64_and_bad_ones_are_left_to_max() -> None:
    from maxkv.serving.pipelines.choices import SEED_STRIDE, ZERO_SEED, choice_seed

    # MAX draws a row's token with the key seed + its token count: choices 2^32 apart
    # never share a key (seed + j would give choice j+1 choice j's next draw).
    assert SEED_STRIDE == 2**32
    for seed, expected in [
        (5, [5, 5 + 2**32, 5 + 2**33]),
        (0, [ZERO_SEED, 2**32, 2**33]),  # (0 is MAX's "random")
        (2**63 - 1, [2**63 - 1, -(2**63) + 2**32 - 1, -(2**63) + 2**33 - 1]),  # int64 wraps
        (-(2**32), [-(2**32), ZERO_SEED, 2**32]),
        ("7", [7, 7 + 2**32, 7 + 2**33]),  # as MAX's schema reads them
        (7.0, [7, 7 + 2**32, 7 + 2**33]),
        (2**64, [2**64] * 3),  # not a 64-bit integer: MAX's check answers 400
        ("x", ["x"] * 3),  # (MAX's schema answers 400)
        (7.5, [7.5] * 3),
    ]:
        got = [choice_seed(seed, j) for j in range(3)]
        assert got == expected, (seed, got)
