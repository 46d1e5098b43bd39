"""KV tiers and preemption on the real model: the tokens never change.

Preemption by swap and by recompute under a page budget too small for the
batch gives transformers' tokens; a second
process pointed at the same Redis loads the prefix the first computed and
gives the first's tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
from max.driver import CPU
from max.engine import InferenceSession

from maxkv import PagedKVCacheManager
from maxkv.models import DecoderModel
from maxkv.models.decoder import cache_params
from maxkv.models.resolve import LoadedModel
from maxkv.serving.scheduler import ContinuousBatchingScheduler
from maxkv.tiers import TierConfig
from maxkv.tiers.local_server import LocalRedisServer as RedisServer

from .conftest import requires_transformers
from .forgery import forge_every_block
from .test_sequence_ops import SYSTEM

pytestmark = pytest.mark.model

QUESTIONS = [
    "Where are the fossils?",
    "When is the museum open?",
    "Can I take photos?",
    "How much is a ticket?",
    "Where is the cafe?",
    "Do you have meteorites?",
]
_models: dict[str, DecoderModel] = {}


def paged_manager(
    smollm2: LoadedModel, session: InferenceSession, num_pages: int, tiers: TierConfig | None = None
) -> PagedKVCacheManager:
    config = smollm2.config
    return PagedKVCacheManager(
        cache_params(config),
        16,
        num_pages,
        4,
        512,
        config.num_hidden_layers,
        [CPU()],
        session,
        enable_prefix_caching=True,
        tiers=tiers,
    )


def model_for(
    smollm2: LoadedModel, session: InferenceSession, manager: PagedKVCacheManager
) -> DecoderModel:
    if "paged" not in _models:  # one graph for every paged manager of 16-token pages
        _models["paged"] = DecoderModel(
            smollm2.config, smollm2.weights, manager, session, quantized=smollm2.quantized
        )
    return _models["paged"]


def test_preemption_by_swap_and_recompute_keeps_the_tokens(
    smollm2: LoadedModel, session: InferenceSession
) -> None:
    tokenizer = smollm2.tokenizer
    assert tokenizer is not None
    prompts = [tokenizer.encode_chat(q, system=SYSTEM) for q in QUESTIONS]
    new_tokens = 64
    requires_transformers()
    from maxkv.models.hf import hf_from_pretrained, hf_generate

    assert smollm2.path is not None
    expected = hf_generate(
        hf_from_pretrained(smollm2.path), prompts, new_tokens, smollm2.config.eos_token_ids
    )
    # Waiting for pages (no preemption) is the demo's own test; here the two
    # preemption policies, each against transformers.
    for policy in ("swap", "recompute"):
        tiers = TierConfig(model_id="smollm2-test") if policy == "recompute" else None
        manager = paged_manager(smollm2, session, 30, tiers)  # 4 in flight need ~37 pages
        scheduler = ContinuousBatchingScheduler(
            model_for(smollm2, session, manager), manager, 4, num_steps=4, preemption=policy
        )
        for prompt in prompts:
            scheduler.submit(prompt, new_tokens)
        outputs, stats = scheduler.run()
        assert manager.free_pages == 30 and manager.swapped_bytes == 0  # nothing leaked
        manager.close()
        assert outputs == expected, policy
        assert stats.preemptions > 0, policy
        if policy == "swap":
            assert stats.recomputed_tokens == 0
        else:
            assert stats.recomputed_tokens > 0


#: The secret both processes sign their blocks with.
SECRET = "model-test-secret-0123456789"

_FIRST_PROCESS = """
import json, sys
from max.driver import CPU
from max.engine import InferenceSession
from maxkv import PagedKVCacheManager
from maxkv.models import DecoderModel
from maxkv.models.decoder import cache_params
from maxkv.models.resolve import open_model
from maxkv.serving.scheduler import ContinuousBatchingScheduler
from maxkv.tiers import TierConfig

gguf, url, prompts, secret = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
model = open_model(gguf, progress=False)
session = InferenceSession(devices=[CPU()])
config = model.config
manager = PagedKVCacheManager(
    cache_params(config), 16, 64, 4, 512, config.num_hidden_layers, [CPU()], session,
    enable_prefix_caching=True,
    tiers=TierConfig(model_id="smollm2-test", redis_url=url, secret=secret),
)
llama = DecoderModel(config, model.weights, manager, session, quantized=model.quantized)
scheduler = ContinuousBatchingScheduler(llama, manager, 4, num_steps=4)
for prompt in prompts:
    scheduler.submit(prompt, 12)
outputs, _ = scheduler.run()
manager.close()  # every block written to Redis
print(json.dumps({"outputs": outputs, "redis_writes": manager.tiers.stats.redis_writes}))
"""


@pytest.mark.redis
def test_a_second_process_reuses_the_prefix_through_redis(
    smollm2: LoadedModel, smollm2_gguf: Path, session: InferenceSession, redis_server: RedisServer
) -> None:
    tokenizer = smollm2.tokenizer
    assert tokenizer is not None
    prompts = [tokenizer.encode_chat(q, system=SYSTEM) for q in QUESTIONS[:2]]
    first = subprocess.run(
        [
            sys.executable,
            "-c",
            _FIRST_PROCESS,
            str(smollm2_gguf),
            redis_server.url,
            json.dumps(prompts),
            SECRET,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),
        check=False,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    report = json.loads(first.stdout.strip().splitlines()[-1])
    assert report["redis_writes"] >= (len(prompts[0]) - 1) // 16

    def run(**tier_options: object) -> tuple[list[list[int]], Any, Any]:
        """The prompts in this process on a fresh cache (its own host tier, the shared Redis)."""
        tiers = TierConfig(model_id="smollm2-test", redis_url=redis_server.url, **tier_options)  # type: ignore[arg-type]
        manager = paged_manager(smollm2, session, 64, tiers)
        scheduler = ContinuousBatchingScheduler(
            model_for(smollm2, session, manager), manager, 4, num_steps=4
        )
        for prompt in prompts:
            scheduler.submit(prompt, 12)
        outputs, _ = scheduler.run()
        manager.close()
        return outputs, scheduler.requests(), manager

    # The same secret: the first prompt's whole pages come from Redis, the same tokens.
    outputs, requests, manager = run(secret=SECRET)
    pages = (len(prompts[0]) - 1) // 16
    assert outputs == report["outputs"]
    assert requests[0].cached_tokens == pages * 16  # nothing of it was on this device
    assert manager.tiers.stats.redis_hits >= pages
    assert manager.tier_hit_tokens >= requests[0].cached_tokens
    assert not manager.tiers.stats.invalid

    # Every block rewritten with another block's payload, CRC-32s recomputed: none is
    # used, the tokens are unchanged, the refusal counted (the prefix ends at the first).
    client = redis.Redis.from_url(redis_server.url)
    assert forge_every_block(client, "maxkv@") >= pages
    outputs, requests, manager = run(secret=SECRET)
    assert outputs == report["outputs"] and requests[0].cached_tokens == 0
    assert manager.tiers.stats.invalid == {"signature": 1} and manager.tiers.stats.redis_hits == 0

    # That process recomputed the pages and wrote them back, signed.  A process
    # without the secret cannot use them (and says why).
    outputs, requests, manager = run(insecure=True)
    assert outputs == report["outputs"] and requests[0].cached_tokens == 0
    assert manager.tiers.stats.invalid == {"unknown_key": 1} and manager.tiers.stats.redis_hits == 0
