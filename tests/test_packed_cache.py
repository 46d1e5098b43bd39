"""The packed cache (``maxkv.models.packed_cache``): a GGUF's tiles written at the
first load, read back at the next, and refused when what is on disk is not what
was written (packed again), on a small Q4_K_M-style file with IQ4 matrices."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from maxkv.cpu.arrays import is_aligned
from maxkv.models import decoder, load_model
from maxkv.models.decoder import graph_weights

from .gguf_helpers import TINY, hf_weights, write_llama_gguf

pytestmark = pytest.mark.unit

CONFIG = {**TINY, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64}


@pytest.fixture
def gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MAXKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MAXKV_PACKED_CACHE", "1")
    kinds = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "attn_output": "IQ4_XS", "ffn_up": "IQ4_NL"}
    overrides = {f"blk.{i}.{t}.weight": kind for t, kind in kinds.items() for i in range(2)}
    path = tmp_path / "tiny-q4_k_m.gguf"
    write_llama_gguf(
        path, hf_weights(CONFIG, seed=4), CONFIG, matrix_type="Q4_K", overrides=overrides
    )
    return path


def _tiles(path: Path, activations: str = "float32") -> dict[str, np.ndarray]:
    config, weights = load_model(path)
    registry = graph_weights(config, weights, packed=True, activations=activations)
    return {n: a for n, a in registry.items() if n.endswith((".q", ".sm"))}


def _folders(path: Path) -> list[Path]:
    return sorted((path.parent / "cache" / "packed").glob("[!.]*"))


class Packs:
    """Counts :func:`decoder._held_tiles` calls (the tiles packed, not read back)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        pack = decoder._held_tiles

        def counted(*args: object, **kwargs: object) -> object:
            self.calls += 1
            return pack(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(decoder, "_held_tiles", counted)


def test_tiles_are_kept_and_read_back_exactly(gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    packs = Packs(monkeypatch)
    first = _tiles(gguf)
    assert packs.calls == 1 and len(_folders(gguf)) == 1
    again = _tiles(gguf)
    assert packs.calls == 1, "the second load packed again"
    assert sorted(again) == sorted(first)
    for name, array in again.items():
        assert array.dtype == first[name].dtype and array.shape == first[name].shape
        np.testing.assert_array_equal(array, first[name], err_msg=name)
        # As the kernels take weights: aligned, writable, the process's own memory.
        assert is_aligned(array) and array.flags.writeable and array.base is not None


@pytest.mark.parametrize("damage", ["flipped", "truncated", "shape", "manifest", "extra"])
def test_damaged_tiles_are_refused_and_packed_again(
    gguf: Path, monkeypatch: pytest.MonkeyPatch, damage: str, capfd: pytest.CaptureFixture[str]
) -> None:
    packs = Packs(monkeypatch)
    first = _tiles(gguf)
    (folder,) = _folders(gguf)
    manifest_path = folder / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    target = folder / "layers.1.wo.q"
    if damage == "flipped":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 1
        target.write_bytes(bytes(data))
    elif damage == "truncated":
        target.write_bytes(target.read_bytes()[:-64])
    elif damage == "shape":  # the manifest and the file agree, the layout does not
        manifest["arrays"]["layers.1.wo.q"]["shape"][1] //= 2
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
        manifest_path.write_text(json.dumps(manifest))
    elif damage == "manifest":
        manifest_path.write_text("{")
    else:
        manifest["arrays"]["stray"] = manifest["arrays"]["layers.1.wo.q"]
        manifest_path.write_text(json.dumps(manifest))
    again = _tiles(gguf)
    assert packs.calls == 2, "damaged tiles were used"
    assert "packing again" in capfd.readouterr().err
    for name, array in again.items():
        np.testing.assert_array_equal(array, first[name], err_msg=name)
    assert _tiles(gguf) and packs.calls == 2, "the tiles were not written again"


def test_a_rewritten_file_gets_new_tiles_and_the_setting_turns_it_off(
    gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    packs = Packs(monkeypatch)
    _tiles(gguf)
    write_llama_gguf(
        gguf, hf_weights(CONFIG, seed=5), CONFIG, matrix_type="Q4_K"
    )  # same path, new file
    changed = _tiles(gguf)
    assert packs.calls == 2 and len(_folders(gguf)) == 2
    fresh = gguf.with_name("fresh.gguf")
    fresh.write_bytes(gguf.read_bytes())
    monkeypatch.setenv("MAXKV_PACKED_CACHE", "0")
    off = _tiles(fresh)
    assert packs.calls == 3 and len(_folders(gguf)) == 2, "written with the cache off"
    for name, array in off.items():
        np.testing.assert_array_equal(array, changed[name], err_msg=name)


def test_each_activation_mode_keeps_its_own_tiles(
    gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The int8 copies (``MAXKV_ACTIVATIONS=int8``) are kept beside the float32 mode's
    tiles, not over them, and each mode reads its own back: the same bytes, in the
    int8 layout's shape where the matrix is integers."""
    packs = Packs(monkeypatch)
    rows = _tiles(gguf)
    int8 = _tiles(gguf, "int8")
    assert packs.calls == 2 and len(_folders(gguf)) == 2
    assert _tiles(gguf).keys() == rows.keys() and _tiles(gguf, "int8").keys() == int8.keys()
    assert packs.calls == 2, "a mode's tiles were packed again"
    q = "layers.0.wqkv.q"
    assert int8[q].shape[0] == 4 * rows[q].shape[0] and int8[q].nbytes == rows[q].nbytes
    for name, array in int8.items():
        if name.endswith(".sm"):
            np.testing.assert_array_equal(array, rows[name], err_msg=name)
