"""A request that ends stops generating everywhere (:mod:`maxkv.serving.pipelines.cancels`):
its other prompts on the API server, a cancel that overtakes its request in the
model worker.  (Against a real server: ``tests/test_serve_fuzz.py``.)"""

from __future__ import annotations

import asyncio
import queue
from typing import Any

import pytest

pytestmark = pytest.mark.unit


def test_cancels_are_remembered_for_their_time_then_forgotten() -> None:
    from maxkv.serving.pipelines.cancels import CancelMemory

    now = [100.0]
    memory = CancelMemory(seconds=10.0, clock=lambda: now[0])
    assert memory(["a"]) == ["a"]
    now[0] = 105.0
    assert memory([]) == ["a"]  # a request that arrives after its cancel is still cancelled
    assert memory(["b"]) == ["a", "b"]
    now[0] = 110.0
    assert memory([]) == ["b"]  # "a" is ten seconds old
    assert memory(["b"]) == ["b"]  # received again: remembered from now on
    now[0] = 119.0
    assert memory([]) == ["b"]
    now[0] = 120.0
    assert memory([]) == []


class _Queue:
    """MAX's pull queue interface (``get_nowait``, ``queue.Empty`` when empty)."""

    def __init__(self, items: list[list[str]]) -> None:
        self.items = items

    def get_nowait(self) -> list[str]:
        if not self.items:
            raise queue.Empty
        return self.items.pop(0)


def test_the_schedulers_cancel_drain_remembers_each_cancel() -> None:
    from maxkv import seams
    from maxkv.serving.pipelines.cancels import remember_cancels

    original = seams.CANCELLED_REQUESTS.resolve()
    original = getattr(original, "__wrapped__", original)  # (maxkv.pipelines wraps it)
    with seams.CANCELLED_REQUESTS.replaced(original):
        assert original(_Queue([["x"]])) == ["x"]
        assert original(_Queue([])) == []  # MAX's: a cancel is seen once
        remember_cancels()
        remember_cancels()  # (once per process)
        drain = seams.CANCELLED_REQUESTS.resolve()
        assert getattr(drain, "__wrapped__", None) is original
        assert drain(_Queue([["x"], ["y"]])) == ["x", "y"]
        assert drain(_Queue([])) == ["x", "y"]  # and again next batch
    assert seams.CANCELLED_REQUESTS.resolve() is not drain


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


def test_choice_seeds_stay_in_int64_and_leave_bad_ones_to_max() -> None:
    from maxkv.serving.pipelines.choices import ZERO_SEED, plan_choices

    body: dict[str, Any] = {"prompt": "a", "n": 3}
    plan = plan_choices(body, chat=False)
    assert plan is not None
    for seed, expected in [
        (5, [5, 6, 7]),
        (0, [ZERO_SEED, 1, 2]),  # (0 is MAX's "random")
        (2**63 - 2, [2**63 - 2, 2**63 - 1, 1]),  # (int64 wraps past 0)
        (-2, [-2, -1, ZERO_SEED]),
        (2**64, [2**64] * 3),  # not a 64-bit integer: MAX's check answers 400
    ]:
        assert [plan.body({**body, "seed": seed}, j)["seed"] for j in range(3)] == expected
