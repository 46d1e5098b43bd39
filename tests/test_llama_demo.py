"""The multistep continuous-batching demo against Hugging Face transformers.

Tiny random Llamas are saved with ``save_pretrained(safe_serialization=True)``,
loaded by maxkv from disk, run through the scheduler with more prompts than
batch slots at ``num_steps`` 1 and 4, and compared token for token with
``LlamaForCausalLM.generate(do_sample=False)``.  Skipped where torch is absent.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from max.driver import CPU
from max.engine import InferenceSession

from maxkv import ContinuousBatchingKVCacheManager
from maxkv.models import DecoderConfig, DecoderModel, ModelLoadError, default_llama, load_model
from maxkv.models.decoder import cache_params
from maxkv.models.reference import greedy_reference
from maxkv.serving.scheduler import ContinuousBatchingScheduler

DEMO = Path(__file__).resolve().parents[1] / "examples" / "multistep_decode.py"
PROMPT_LENGTHS = [1, 30, 5, 17, 2, 9, 24]
MAX_NEW_TOKENS = 8


def save_tiny_llama(directory: Path, *, heads: int, kv_heads: int, layers: int, seed: int) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        initializer_range=0.15,
        eos_token_id=2,
        bos_token_id=1,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, safe_serialization=True)


@pytest.mark.compile
@pytest.mark.parametrize(
    ("heads", "kv_heads", "layers"),
    [(4, 2, 2), pytest.param(2, 2, 3, marks=pytest.mark.sweep)],
    ids=["gqa-head_dim16-2layers", "mha-head_dim32-3layers"],
)
def test_greedy_tokens_match_transformers(
    tmp_path: Path, session: InferenceSession, heads: int, kv_heads: int, layers: int
) -> None:
    save_tiny_llama(tmp_path, heads=heads, kv_heads=kv_heads, layers=layers, seed=heads + layers)
    from maxkv.models.hf import hf_from_pretrained, hf_generate

    config, weights = load_model(tmp_path)
    assert config.head_dim == 64 // heads
    rng = np.random.default_rng(layers)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    expected = hf_generate(hf_from_pretrained(tmp_path), prompts, MAX_NEW_TOKENS)

    max_batch = 3  # fewer slots than prompts: requests join and leave mid-flight
    manager = ContinuousBatchingKVCacheManager(
        cache_params(config), max_batch, 48, config.num_hidden_layers, [CPU()], session
    )
    model = DecoderModel(config, weights, manager, session)
    syncs = {}
    for num_steps in (1, 4):
        scheduler = ContinuousBatchingScheduler(model, manager, max_batch, num_steps)
        for prompt in prompts:
            scheduler.submit(prompt, MAX_NEW_TOKENS)
        outputs, stats = scheduler.run()
        assert outputs == expected, f"num_steps={num_steps}"
        assert stats.generated_tokens == sum(len(o) for o in expected)
        assert manager.slots_remaining == max_batch
        syncs[num_steps] = stats.host_syncs_per_token
    assert syncs[4] < syncs[1]
    # The NumPy full-recompute reference agrees too (it is what --verify uses).
    for prompt, want in zip(prompts[:3], expected[:3], strict=True):
        assert greedy_reference(config, weights, prompt, MAX_NEW_TOKENS) == want


def run_demo(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(DEMO), *args], capture_output=True, text=True, timeout=timeout
    )


def assert_one_error_line(result: subprocess.CompletedProcess[str], message: str) -> None:
    """Exit code 2, and standard error is exactly one ``error:`` line holding ``message``."""
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line and "Crashpad" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.stderr + result.stdout


#: A minimal valid Llama config.json (1 layer, 2 query heads over 1 KV head of 8).
SMALL_CONFIG: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def write_config(directory: Path, **overrides: object) -> None:
    config = {**SMALL_CONFIG, **overrides}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.compile
def test_bad_model_dirs_end_with_one_error_line(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    missing = tmp_path / "missing"
    gpt2 = tmp_path / "gpt2"
    write_config(gpt2, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    no_weights = tmp_path / "no_weights"
    write_config(no_weights)
    bad_shape = tmp_path / "bad_shape"
    write_config(bad_shape)
    config = DecoderConfig.from_hf(json.loads((bad_shape / "config.json").read_text()))
    weights = {n: np.zeros(s, np.float32) for n, s in config.weight_shapes().items()}
    weights["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 16), np.float32)
    save_file(weights, str(bad_shape / "model.safetensors"))

    cases = {
        missing: "model path",
        gpt2: "unsupported architecture",
        no_weights: "no *.safetensors",
        bad_shape: "k_proj.weight has shape (16, 16), config implies (8, 16)",
    }
    for directory, message in cases.items():
        assert_one_error_line(run_demo("--model-dir", str(directory)), message)


@pytest.mark.compile
@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[[1, 2], 3]", "prompt 1 must be a non-empty string or a non-empty list of token ids"),
        ("[[1, 2], []]", "prompt 1 must be a non-empty string"),
        ("[]", "must hold a non-empty JSON list of prompts"),
        ("{", "cannot read prompts"),
        ('["hello"]', "prompt 0 is text, but model tiny has no tokenizer"),
    ],
)
def test_bad_prompts_json_is_one_error_line(tmp_path: Path, content: str, message: str) -> None:
    prompts = tmp_path / "prompts.json"
    prompts.write_text(content)
    assert_one_error_line(run_demo("--model", "tiny", "--prompts-json", str(prompts)), message)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "longrope"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_configs_are_refused(change: dict[str, object], message: str) -> None:
    raw = {**SMALL_CONFIG, **change}
    with pytest.raises(ModelLoadError, match=message):
        DecoderConfig.from_hf(raw)


@pytest.mark.unit
def test_default_model_is_deterministic() -> None:
    a_config, a = default_llama()
    b_config, b = default_llama()
    assert a_config == b_config
    assert all(np.array_equal(a[name], b[name]) for name in a)


@pytest.mark.compile
def test_scheduler_rejects_requests_that_cannot_fit(session: InferenceSession) -> None:
    config, _ = default_llama()

    class NoModel:  # the checks run before any model step
        pass

    fake = NoModel()
    fake.config = config  # type: ignore[attr-defined]
    fake.device = CPU()  # type: ignore[attr-defined]
    fake.max_positions = 512  # type: ignore[attr-defined]
    manager = ContinuousBatchingKVCacheManager(
        cache_params(config), 2, 16, config.num_hidden_layers, [CPU()], session
    )
    scheduler = ContinuousBatchingScheduler(fake, manager, 2, num_steps=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs 17 cache positions; the limit is 16"):
        scheduler.submit([1] * 10, 8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        scheduler.submit([1, 256], 2)
    with pytest.raises(ValueError, match="must not be empty"):
        scheduler.submit([], 2)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        scheduler.submit([1], 0)
    with pytest.raises(ValueError, match="exceeds the manager's 2 free slots"):
        ContinuousBatchingScheduler(fake, manager, 3)  # type: ignore[arg-type]


@pytest.mark.compile
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--n", "0"), "must be >= 1"),
        (("--n", "9", "--max-batch-size", "8"), "--n 9 completions do not fit"),
        (("--n", "2", "--verify"), "cannot check sampled completions"),
        (("--temperature", "-1"), "--temperature must be >= 0"),
    ],
)
def test_bad_sampling_options_are_one_error_line(args: tuple[str, ...], message: str) -> None:
    assert_one_error_line(run_demo("--model", "tiny", *args), message)
