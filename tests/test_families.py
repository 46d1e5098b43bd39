"""Every family maxkv registers against transformers, on small random checkpoints.

For each family (``tests/family_checkpoints.py``: Llama 3 with ``llama3``
RoPE scaling, Qwen 2.5, Qwen 3, Mistral with a sliding window, Gemma 3 with
interleaved sliding and full layers) transformers writes a checkpoint and
maxkv loads it from disk:

- paged cache with prefix caching, through the continuous-batching scheduler
  (more prompts than slots, so requests join mid-flight: prefill, decode and
  mixed steps; prompts share a prefix; sliding families' prompts run past
  their window): greedy tokens equal ``generate(do_sample=False)``'s;
- contiguous cache, ``output="logits"`` (Llama 3 and the sliding families): a
  ragged prefill past the window, a mixed step and a decode step give every
  sequence's last-token logits as transformers computes them on the whole
  sequence.

Checkpoints that set what maxkv does not implement are refused by name.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.engine import InferenceSession

from maxkv import ContinuousBatchingKVCacheManager, HybridKVCacheManager, PagedKVCacheManager
from maxkv.cache.paged import UNUSED_PAGE
from maxkv.models import DecoderModel, ModelLoadError, load_model
from maxkv.models.decoder import cache_params
from maxkv.serving.scheduler import ContinuousBatchingScheduler
from maxkv.tiers import TierConfig
from maxkv.tiers.local_server import LocalRedisServer

from .conftest import skip_unless_sweeps
from .family_checkpoints import (
    ALL_SLIDING,
    FAMILIES,
    HYBRID,
    SLIDING,
    WINDOW,
    save_family_checkpoint,
)

pytest.importorskip("torch")  # transformers writes the checkpoints and is the reference

NEW_TOKENS = 8
PAGE_SIZE = 16


def prompts_for(family: str, vocab: int, seed: int) -> list[list[int]]:
    """Six prompts, three sharing a 48-token prefix; past the window where one exists."""
    rng = np.random.default_rng(seed)
    long = WINDOW + 40 if family in SLIDING else 60
    shared = rng.integers(3, vocab, 48).tolist()
    lengths = [long, 7, 33, long + 25]
    prompts = [rng.integers(3, vocab, n).tolist() for n in lengths]
    prompts += [shared + rng.integers(3, vocab, n).tolist() for n in (5, long - 40, 1)]
    return prompts


#: Families the default run leaves to ``--sweeps`` on the paged cache (one graph
#: compile each, about 4 minutes cold on two cores): Mistral's window is Gemma 3's
#: kind of layer; Qwen 3 is Qwen 2 with q/k norms, which Gemma 3 has too.
PAGED_SWEEP = ("mistral", "qwen3")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family = str(request.param)
    return save_family_checkpoint(tmp_path_factory.mktemp(f"{family}-"), family, seed=len(family))


def family_of(checkpoint: Path) -> str:
    """The family of a :func:`checkpoint` directory (``<family>-<n>``)."""
    family = checkpoint.name.rsplit("-", 1)[0]
    assert family in FAMILIES, checkpoint
    return family


@pytest.mark.compile
def test_greedy_tokens_match_transformers_paged_prefix_cached(
    checkpoint: Path, session: InferenceSession, request: pytest.FixtureRequest
) -> None:
    from maxkv.models.hf import hf_from_pretrained, hf_generate

    family = family_of(checkpoint)
    if family in PAGED_SWEEP:
        skip_unless_sweeps(request)
    config, weights = load_model(checkpoint)
    prompts = prompts_for(family, config.vocab_size, seed=3)
    assert config.sliding == (family in SLIDING)
    assert not config.sliding or max(len(p) for p in prompts) > WINDOW
    expected = hf_generate(hf_from_pretrained(checkpoint), prompts, NEW_TOKENS)

    max_batch = 3
    max_len = max(len(p) for p in prompts) + NEW_TOKENS
    pages = max_batch * -(-max_len // PAGE_SIZE) + 16
    manager: PagedKVCacheManager | HybridKVCacheManager
    if family in HYBRID:  # a layer group per window: the sliding layers give pages back
        manager = HybridKVCacheManager(
            cache_params(config),
            PAGE_SIZE,
            [pages, pages],
            max_batch,
            max_len,
            config.layer_windows,
            [CPU()],
            session,
            enable_prefix_caching=True,
        )
        groups = manager.groups
    else:
        manager = PagedKVCacheManager(
            cache_params(config),
            PAGE_SIZE,
            pages,
            max_batch,
            max_len,
            config.num_hidden_layers,
            [CPU()],
            session,
            enable_prefix_caching=True,
            sliding_window=config.cache_window,
        )
        groups = manager.groups  # one page table
    assert (config.cache_window is not None) == (family in ALL_SLIDING)
    model = DecoderModel(config, weights, manager, session)
    scheduler = ContinuousBatchingScheduler(model, manager, max_batch, num_steps=2)
    for prompt in prompts:
        scheduler.submit(prompt, NEW_TOKENS)
    # After every commit, a sequence holds only its window's pages (and the one its
    # next step reserved) in a sliding group, every page in a full-attention one.
    held_after_steps: list[int] = []
    commit = manager.step

    def step(*args: Any, **kwargs: Any) -> None:
        commit(*args, **kwargs)
        for group in groups:
            for seq in manager.cache_lengths:
                row = group.pages(seq)
                if group.window.slides:
                    held_after_steps.append(len(row) - row.count(UNUSED_PAGE))
                else:
                    assert UNUSED_PAGE not in row

    manager.step = step  # type: ignore[method-assign]
    outputs, _ = scheduler.run()
    assert outputs == expected
    assert manager.prefix_cache_stats.hit_tokens > 0  # the shared prefix was reused
    sliding = [g for g in groups if g.window.slides]
    assert bool(sliding) == (family in SLIDING)
    for group in sliding:
        bound = group.window.max_live_pages()
        assert bound is not None and max(held_after_steps) <= bound + 1
        assert max(held_after_steps) < -(-max(len(p) for p in prompts) // PAGE_SIZE)


#: The families whose logits are also checked on the contiguous cache: RoPE
#: scaling and the sliding windows (the blocks of the others do not depend on
#: the cache; one graph compile per family and cache kind, kept to the CI budget).
CONTIGUOUS = ("llama3", *SLIDING)


@pytest.mark.compile
@pytest.mark.sweep  # the contiguous cache: SmolLM2 (tests/test_models.py); these families: paged
def test_ragged_logits_match_transformers_contiguous(
    checkpoint: Path, session: InferenceSession
) -> None:
    torch = pytest.importorskip("torch")
    from maxkv.models.hf import hf_from_pretrained

    family = family_of(checkpoint)
    if family not in CONTIGUOUS:
        pytest.skip(f"{family}: checked on the paged cache (CONTIGUOUS)")
    config, weights = load_model(checkpoint)
    hf = hf_from_pretrained(checkpoint)
    long = WINDOW + 30 if family in SLIDING else 40
    manager = ContinuousBatchingKVCacheManager(
        cache_params(config), 3, long + 16, config.num_hidden_layers, [CPU()], session
    )
    model = DecoderModel(config, weights, manager, session, output="logits")
    rng = np.random.default_rng(5)
    seqs = manager.claim(3)
    history: dict[int, list[int]] = {seq: [] for seq in seqs}
    for lengths in ([long, 30, 5], [1, 1, 3], [1, 1, 1]):
        chunks = [rng.integers(3, config.vocab_size, n).tolist() for n in lengths]
        (inputs,) = manager.fetch(seqs, active_lengths=lengths)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.uint32)
        tokens = np.concatenate([np.asarray(c, dtype=np.int64) for c in chunks])
        logits = model.execute(Buffer.from_numpy(tokens), Buffer.from_numpy(offsets), inputs)
        manager.step(dict(zip(seqs, lengths, strict=True)))
        got = logits.to_numpy()
        for row, (seq, chunk) in enumerate(zip(seqs, chunks, strict=True)):
            history[seq] += chunk
            with torch.no_grad():
                want = hf(torch.tensor([history[seq]])).logits[0, -1].float().numpy()
            scale = float(np.abs(want).max())
            np.testing.assert_allclose(got[row], want, rtol=0, atol=2e-4 * max(1.0, scale))
    for seq in seqs:
        manager.release(seq)


def _write_config(directory: Path, family: str, **changes: object) -> Path:
    """``family``'s checkpoint whose ``config.json`` then gets ``changes``."""
    save_family_checkpoint(directory, family)
    raw = json.loads((directory / "config.json").read_text())
    raw.update(changes)
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


@pytest.mark.unit
@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        ("llama3", {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
        ("llama3", {"mlp_bias": True}, "mlp_bias"),
        ("llama3", {"hidden_act": "gelu"}, "hidden_act"),
        (
            "qwen3",
            {
                "use_sliding_window": True,
                "sliding_window": 64,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            "at least 128",
        ),
        ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("llama3", {"architectures": ["FalconForCausalLM"]}, "FalconForCausalLM"),
        # MAX's graph compiler fails on such a head ("Failed to compile the model")
        ("qwen3", {"head_dim": 80}, "head_dim 80 is not a power of two"),
    ],
    ids=[
        "rope-type",
        "mlp-bias",
        "activation",
        "window",
        "softcap",
        "bidirectional",
        "arch",
        "head-dim",
    ],
)
def test_unsupported_settings_are_refused_by_name(
    tmp_path: Path, family: str, changes: dict[str, object], message: str
) -> None:
    with pytest.raises(ModelLoadError, match=message):
        load_model(_write_config(tmp_path, family, **changes))


@pytest.mark.unit
@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "truncate": False,
        },
    ],
    ids=["default", "linear", "dynamic", "llama3", "yarn", "yarn-mscale"],
)
def test_rope_frequencies_match_transformers(rope: dict[str, object]) -> None:
    """maxkv's NumPy RoPE of each type against transformers' ``ROPE_INIT_FUNCTIONS``:
    the inverse frequencies and the attention factor, and the table built from them."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from maxkv.models.rope import RopeScaling, rope_table

    theta, head_dim, positions = 500000.0, 128, 131072
    hf = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        max_position_embeddings=positions,
        rope_parameters={"rope_theta": theta, **rope},
    )
    kind = str(rope["rope_type"])
    if kind == "default":
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        factor = 1.0
    else:
        inv, factor = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    scaling = RopeScaling.from_hf(rope)
    ours, our_factor = (
        scaling.inv_freq(theta, head_dim)
        if scaling
        else (1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim), 1.0)
    )
    # transformers computes in float32: agreement to float32's rounding.
    np.testing.assert_allclose(ours, inv.double().numpy(), rtol=3e-6, atol=0)
    assert our_factor == pytest.approx(float(factor), rel=1e-6)
    table = rope_table(head_dim, 64, theta, scaling)
    angles = np.arange(64)[:, None] * ours[None, :]
    want = np.stack([np.cos(angles), np.sin(angles)], -1).reshape(64, head_dim) * our_factor
    np.testing.assert_allclose(table, want, atol=1e-6)


@pytest.mark.compile
def test_a_family_added_in_one_module_runs(tmp_path: Path, session: InferenceSession) -> None:
    """``tests/toy_family.py`` is a whole family (a module, then one
    ``register_family`` line): its checkpoint loads and decodes as transformers does."""
    from maxkv.models import register_family, registered_architectures
    from maxkv.models.hf import hf_from_pretrained, hf_generate

    from . import toy_family

    register_family(toy_family.FAMILY)
    assert registered_architectures()["ToyForCausalLM"] is toy_family.FAMILY
    full = ["full_attention", "full_attention"]
    _write_config(tmp_path, "gemma3", architectures=["ToyForCausalLM"], layer_types=full)
    config, weights = load_model(tmp_path)
    assert config.family == "toy" and not config.sliding
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (9, 40, 1)]
    expected = hf_generate(hf_from_pretrained(tmp_path), prompts, NEW_TOKENS)
    manager = ContinuousBatchingKVCacheManager(
        cache_params(config), 2, 64, config.num_hidden_layers, [CPU()], session
    )
    scheduler = ContinuousBatchingScheduler(
        DecoderModel(config, weights, manager, session), manager, 2
    )
    for prompt in prompts:
        scheduler.submit(prompt, NEW_TOKENS)
    outputs, _ = scheduler.run()
    assert outputs == expected


@pytest.mark.compile
def test_gemma3_on_the_hybrid_cache_over_several_windows(
    tmp_path: Path, session: InferenceSession
) -> None:
    """A prompt and an answer several windows long on the hybrid cache: the sliding
    layers' pages go back while the full-attention layers keep every token, and the
    greedy tokens are transformers'."""
    from maxkv.models.hf import hf_from_pretrained, hf_generate

    directory = save_family_checkpoint(tmp_path, "gemma3", seed=11)
    config, weights = load_model(directory)
    rng = np.random.default_rng(4)
    # 3.5 windows in all (the checkpoint's context is 512), the answer past one window.
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (2 * WINDOW + 30, 40)]
    new_tokens = WINDOW + 40
    expected = hf_generate(hf_from_pretrained(directory), prompts, new_tokens)
    max_len = len(prompts[0]) + new_tokens
    manager = HybridKVCacheManager(
        cache_params(config),
        PAGE_SIZE,
        # the sliding layers: both prompts' pages at once, then two windows
        [40, 2 * -(-max_len // PAGE_SIZE)],
        2,
        max_len,
        config.layer_windows,
        [CPU()],
        session,
    )
    model = DecoderModel(config, weights, manager, session)
    scheduler = ContinuousBatchingScheduler(model, manager, 2, num_steps=1)
    for prompt in prompts:
        scheduler.submit(prompt, new_tokens)
    outputs, _ = scheduler.run()
    assert outputs == expected
    sliding, full = manager.groups
    assert sliding.window.window == WINDOW and full.window.window is None
    # The sliding layer ran in 40 pages, fewer than the two sequences of it
    # would have held without giving pages back.
    answered = [len(p) + new_tokens for p in prompts]
    assert sliding.num_pages < sum(-(-n // PAGE_SIZE) for n in answered)
    assert manager.free_pages == manager.num_pages
    # Preemption on the hybrid cache, by swap (every group's live pages to host
    # memory and back) and by recompute, with too few full-attention pages for both
    # answers at once: the same graph, the same tokens.
    full_pages = max(-(-n // PAGE_SIZE) for n in answered) + 4
    assert full_pages < sum(-(-n // PAGE_SIZE) for n in answered)
    for policy in ("swap", "recompute"):
        tight = HybridKVCacheManager(
            cache_params(config),
            PAGE_SIZE,
            [40, full_pages],
            2,
            max_len,
            config.layer_windows,
            [CPU()],
            session,
            enable_prefix_caching=policy == "recompute",
        )
        scheduler = ContinuousBatchingScheduler(model, tight, 2, preemption=policy)
        for prompt in prompts:
            scheduler.submit(prompt, new_tokens)
        outputs, stats = scheduler.run()
        assert outputs == expected, policy
        assert stats.preemptions > 0, policy
        assert (stats.recomputed_tokens > 0) == (policy == "recompute")
        assert tight.free_pages == tight.num_pages and tight.swapped_bytes == 0


#: A process that runs Gemma 3 on the hybrid cache with a signed Redis tier and
#: reports its tokens (argv: checkpoint, Redis URL, prompts, secret).
_GEMMA3_FIRST_PROCESS = """
import json, sys
from max.driver import CPU
from max.engine import InferenceSession
from maxkv import HybridKVCacheManager
from maxkv.models import DecoderModel, load_model
from maxkv.models.decoder import cache_params
from maxkv.serving.scheduler import ContinuousBatchingScheduler
from maxkv.tiers import TierConfig

directory, url, prompts, secret = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
config, weights = load_model(directory)
session = InferenceSession(devices=[CPU()])
tiers = TierConfig(model_id="gemma3-test", redis_url=url, secret=secret)
manager = HybridKVCacheManager(
    cache_params(config), 16, [40, 40], 2, 512, config.layer_windows, [CPU()], session,
    enable_prefix_caching=True, tiers=tiers,
)
scheduler = ContinuousBatchingScheduler(DecoderModel(config, weights, manager, session), manager, 2)
for prompt in prompts:
    scheduler.submit(prompt, 8)
outputs, _ = scheduler.run()
manager.close()  # every block written to Redis
writes = [group.tiers.stats.redis_writes for group in manager.groups]
print(json.dumps({"outputs": outputs, "redis_writes": writes}))
"""


@pytest.mark.compile
@pytest.mark.redis
def test_gemma3_reloads_its_prefix_from_redis_in_a_second_process(
    tmp_path: Path, session: InferenceSession, redis_server: LocalRedisServer
) -> None:
    """The hybrid cache with KV tiers: a first process writes every layer group's
    pages to Redis, signed; this one loads the prompt's prefix from there (the full
    group all of it, the sliding group its window) and gives the same tokens as
    transformers.  Without the secret, nothing is loaded."""
    from maxkv.models.hf import hf_from_pretrained, hf_generate

    directory = save_family_checkpoint(tmp_path / "gemma3", "gemma3", seed=11)
    config, weights = load_model(directory)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (2 * WINDOW + 30, 40)]
    expected = hf_generate(hf_from_pretrained(directory), prompts, NEW_TOKENS)
    secret = "gemma3-test-secret-0123456789"
    first = subprocess.run(
        [sys.executable, "-c", _GEMMA3_FIRST_PROCESS, str(directory), redis_server.url,
         json.dumps(prompts), secret],
        capture_output=True, text=True, timeout=900, env=dict(os.environ), check=False,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    report = json.loads(first.stdout.strip().splitlines()[-1])
    assert report["outputs"] == expected
    pages = (len(prompts[0]) - 1) // PAGE_SIZE
    assert report["redis_writes"][1] >= pages  # the full-attention group's, all of them

    model: DecoderModel | None = None

    def run(**tier_options: Any) -> tuple[list[list[int]], Any, HybridKVCacheManager]:
        nonlocal model
        tiers = TierConfig(model_id="gemma3-test", redis_url=redis_server.url, **tier_options)
        manager = HybridKVCacheManager(
            cache_params(config), PAGE_SIZE, [40, 40], 2, 512, config.layer_windows, [CPU()],
            session, enable_prefix_caching=True, tiers=tiers,
        )  # fmt: skip
        if model is None:
            model = DecoderModel(config, weights, manager, session)
        scheduler = ContinuousBatchingScheduler(model, manager, 2)
        for prompt in prompts:
            scheduler.submit(prompt, NEW_TOKENS)
        outputs, _ = scheduler.run()
        manager.close()
        return outputs, scheduler.requests(), manager

    outputs, requests, manager = run(secret=secret)
    assert outputs == expected
    assert requests[0].cached_tokens == pages * PAGE_SIZE  # none of it on this device
    sliding, full = manager.groups
    assert full.tier_hit_tokens == sum(r.cached_tokens for r in requests)  # all from Redis
    # The sliding layers loaded only their window's pages of the prefix.
    first_needed = sliding.window.first_live_page(pages * PAGE_SIZE) * PAGE_SIZE
    assert sliding.tier_hit_tokens == full.tier_hit_tokens - first_needed
    for group in manager.groups:
        assert group.tiers is not None and group.tiers.stats.redis_hits > 0
        assert not group.tiers.stats.invalid

    outputs, requests, manager = run(insecure=True)  # no secret: no block is trusted
    assert outputs == expected and requests[0].cached_tokens == 0
    assert all(g.tiers is not None and g.tiers.stats.redis_hits == 0 for g in manager.groups)


@pytest.mark.compile
@pytest.mark.sweep  # a bfloat16 cache under attention: tests/test_attention.py
def test_logits_over_a_bfloat16_cache_match_transformers_reading_bfloat16_kv(
    tmp_path: Path, session: InferenceSession
) -> None:
    """A float32 Llama 3 over a paged bfloat16 cache: its last-token logits (ragged
    prefill, mixed, decode) equal transformers' when transformers' attention reads
    keys (after RoPE) and values rounded to bfloat16 as the cache stores them; and
    they differ from float32 KV's by more than the tolerance, so the encoding is
    what is checked."""
    torch = pytest.importorskip("torch")
    from max.dtype import DType
    from transformers.models.llama import modeling_llama

    from maxkv.models.hf import hf_from_pretrained

    checkpoint = save_family_checkpoint(tmp_path, "llama3", seed=11)
    config, weights = load_model(checkpoint)
    hf = hf_from_pretrained(checkpoint)
    params = cache_params(config, cache_dtype=DType.bfloat16)
    manager = PagedKVCacheManager(
        params, PAGE_SIZE, 24, 3, 96, config.num_hidden_layers, [CPU()], session
    )
    model = DecoderModel(config, weights, manager, session, output="logits")

    def bf16(x: Any) -> Any:
        return x.to(torch.bfloat16).to(x.dtype)

    rope = modeling_llama.apply_rotary_pos_emb

    def rounded_rope(*args: Any, **kwargs: Any) -> Any:
        q, k = rope(*args, **kwargs)
        return q, bf16(k)

    def reference(tokens: list[int], rounded: bool) -> np.ndarray:
        hooks = []
        if rounded:
            hooks = [
                layer.self_attn.v_proj.register_forward_hook(lambda m, i, out: bf16(out))
                for layer in hf.model.layers
            ]
            modeling_llama.apply_rotary_pos_emb = rounded_rope
        try:
            with torch.no_grad():
                return hf(torch.tensor([tokens])).logits[0, -1].float().numpy()
        finally:
            modeling_llama.apply_rotary_pos_emb = rope
            for hook in hooks:
                hook.remove()

    rng = np.random.default_rng(7)
    seqs = manager.claim(3)
    history: dict[int, list[int]] = {seq: [] for seq in seqs}
    apart = 0.0
    for lengths in ([40, 21, 5], [1, 1, 3], [1, 1, 1]):
        chunks = [rng.integers(3, config.vocab_size, n).tolist() for n in lengths]
        (inputs,) = manager.fetch(seqs, active_lengths=lengths)
        assert inputs.blocks.dtype == DType.bfloat16
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.uint32)
        tokens = np.concatenate([np.asarray(c, dtype=np.int64) for c in chunks])
        logits = model.execute(Buffer.from_numpy(tokens), Buffer.from_numpy(offsets), inputs)
        manager.step(dict(zip(seqs, lengths, strict=True)))
        got = logits.to_numpy()
        for row, (seq, chunk) in enumerate(zip(seqs, chunks, strict=True)):
            history[seq] += chunk
            want = reference(history[seq], rounded=True)
            atol = 1e-3 * max(1.0, float(np.abs(want).max()))
            np.testing.assert_allclose(got[row], want, rtol=0, atol=atol)
            apart = max(apart, float(np.abs(reference(history[seq], False) - want).max()) / atol)
    assert apart > 1, "float32 KV is within the tolerance: the test would not see the encoding"
    for seq in seqs:
        manager.release(seq)


#: The families whose projections the fused QKV matmul cannot make (a QKV bias,
#: q/k norms): in bfloat16 (the GPU's path) they store K and V apart.
PROJECTED_APART = ("qwen2", "qwen3", "gemma3")


def check_bfloat16_family(
    family: str, directory: Path, device: Any, session: InferenceSession
) -> None:
    """maxkv's bfloat16 graph of ``family`` (MAX's matmul; a QKV bias or q/k norms,
    then ``store_kv_ragged``, and MAX's RoPE) on ``device``: each sequence's
    last-token logits of a ragged prefill and a decode step equal transformers'
    float32 on the same weights rounded to bfloat16, to 3% of their scale plus
    twice transformers' own bfloat16 error on that row (0.6-2.4% of the scale
    on these families; maxkv's is 0.6-4.3%), and so the next token where the
    reference's top two are further apart than twice that.
    Windows are 256: MAX's CPU sliding-window mask in bfloat16 needs a window of
    at least its SIMD width (the GPU's does not).  ``tests/test_gpu.py`` runs it
    on a GPU for every family."""
    torch = pytest.importorskip("torch")
    from max.dtype import DType

    from maxkv.models.hf import hf_from_pretrained

    window = {"sliding_window": 256} if family in SLIDING else {}
    checkpoint = save_family_checkpoint(directory, family, seed=5, **window)
    config, weights = load_model(checkpoint)
    hf: Any = hf_from_pretrained(checkpoint)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    hf_bfloat16 = copy.deepcopy(hf).to(torch.bfloat16)
    params = cache_params(config, DType.bfloat16)
    manager: ContinuousBatchingKVCacheManager | HybridKVCacheManager
    if family in HYBRID:
        manager = HybridKVCacheManager(
            params, PAGE_SIZE, [16, 16], 3, 96, config.layer_windows, [device], session
        )
    else:
        manager = ContinuousBatchingKVCacheManager(
            params, 3, 96, config.num_hidden_layers, [device], session
        )
    model = DecoderModel(config, weights, manager, session, output="logits")
    rng = np.random.default_rng(1)
    seqs = manager.claim(3)
    history: dict[int, list[int]] = {seq: [] for seq in seqs}
    failures: list[str] = []
    for step, lengths in enumerate(([40, 21, 5], [1, 1, 1])):
        chunks = [rng.integers(3, config.vocab_size, n).tolist() for n in lengths]
        (inputs,) = manager.fetch(seqs, active_lengths=lengths)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.uint32)
        tokens = np.concatenate([np.asarray(c, dtype=np.int64) for c in chunks])
        got = model.execute(
            Buffer.from_numpy(tokens).to(device), Buffer.from_numpy(offsets).to(device), inputs
        )
        manager.step(dict(zip(seqs, lengths, strict=True)))
        rows = got.to(CPU()).to_numpy()
        for row, (seq, chunk) in zip(rows, zip(seqs, chunks, strict=True), strict=True):
            history[seq] += chunk
            with torch.no_grad():
                ids = torch.tensor([history[seq]])
                every = hf(ids).logits[0].float().numpy()
                own = hf_bfloat16(ids).logits[0, -1].float().numpy()
            want = every[-1]
            own_error = float(np.abs(own - want).max())
            tolerance = 0.03 * float(np.abs(want).max()) + 2 * own_error
            error = float(np.abs(row - want).max())
            top2 = np.sort(want)[-2:]
            if error >= tolerance:
                failures.append(
                    f"step {step}, sequence {seq}: off by {error:.3g} (tolerance "
                    f"{tolerance:.3g}); {_closest_position(row, every)}"
                )
            elif top2[1] - top2[0] > 2 * tolerance and int(row.argmax()) != int(want.argmax()):
                failures.append(f"step {step}, sequence {seq}: another next token")
    for seq in seqs:
        manager.release(seq)
    assert not failures, f"{family} on {device}:\n" + "\n".join(failures)


def _closest_position(row: np.ndarray, every: np.ndarray) -> str:
    """Which of a sequence's positions' reference logits (``every``, ``[positions,
    vocab]``) ``row`` is nearest: a wrong row that equals another position's
    names the row the head read (or the tokens the graph saw)."""
    errors = np.abs(every - row).max(axis=1)
    best = int(errors.argmin())
    return f"nearest the reference at position {best} of {len(every)} (off by {errors[best]:.3g})"


@pytest.mark.compile
@pytest.mark.parametrize(
    "family",
    # bfloat16 models by default: tests/test_bfloat16.py (a Llama against float64).
    [pytest.param(f, marks=pytest.mark.sweep) for f in PROJECTED_APART],
)
def test_bfloat16_families_with_a_bias_or_qk_norms_match_transformers(
    family: str, tmp_path: Path, session: InferenceSession
) -> None:
    """The GPU's graph for the families it once refused, here on the CPU
    (:func:`check_bfloat16_family`)."""
    check_bfloat16_family(family, tmp_path, CPU(), session)
