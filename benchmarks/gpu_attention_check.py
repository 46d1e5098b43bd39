"""maxkv's attention ops on a GPU, against the NumPy reference of the test suite.

    python benchmarks/gpu_attention_check.py [--shape small|smollm2|h64g1|h16g3]
        [--device gpu|cpu] [--cache contiguous|paged|both] [--weight-scale 0.25]

For each cache kind: one graph (fused QKV matmul -> RoPE ->
flash attention, layer index as an input) is compiled on the device, then four
steps (a ragged prefill, two decode steps, a ragged extension) run over two
layers, and the rotated Q and the attention output are compared with
``tests/reference.py`` in float64.  Prints the compile time and the largest
absolute difference per cache kind and output; exits 1 on any failure.
``h64g1`` (head_dim 64, one query head per KV head) and ``h16g3`` (head_dim
16, three) split SmolLM2's shape (head_dim 64, three) in two;
``--weight-scale`` scales the random QKV weights (the attention logits grow
with its square).
``--device cpu`` runs the same check without a GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import numpy as np
from max.driver import CPU, Accelerator, Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef, Graph, TensorType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.reference import ReferenceLayerCache

from maxkv import ContinuousBatchingKVCacheManager, KVCacheParams
from maxkv import ops as kvops
from maxkv.kernels import kernels_path
from maxkv.paged_manager import PagedKVCacheManager
from maxkv.protocol import KVCacheManagerBase

#: (query heads, KV heads, head_dim, hidden) per --shape.
SHAPES = {
    "small": (4, 2, 16, 32),
    "smollm2": (9, 3, 64, 576),
    "h64g1": (3, 3, 64, 192),
    "h16g3": (6, 2, 16, 96),
}
LAYERS, POSITIONS, THETA = 2, 64, 10000.0
STEPS = ([5, 3, 7], [1, 1, 1], [1, 1, 1], [2, 1, 4])


def make_manager(
    kind: str, params: KVCacheParams, device: Device, session: InferenceSession
) -> KVCacheManagerBase:
    if kind == "contiguous":
        return ContinuousBatchingKVCacheManager(params, 4, 32, LAYERS, [device], session)
    return PagedKVCacheManager(params, 8, 32, 4, 32, LAYERS, [device], session)


def build(
    manager: KVCacheManagerBase, shape: tuple[int, int, int, int], session: InferenceSession
) -> Model:
    heads, kv_heads, head_dim, hidden = shape
    params, ref = manager.params, DeviceRef.from_device(manager.devices[0])
    types = [
        *manager.input_symbols()[0],
        TensorType(DType.float32, ["tokens", hidden], ref),
        TensorType(DType.uint32, ["offsets"], ref),
        TensorType(DType.float32, [(heads + 2 * kv_heads) * head_dim, hidden], ref),
        TensorType(DType.float32, [POSITIONS, head_dim], ref),
        TensorType(DType.uint32, [], DeviceRef.CPU()),
    ]
    with Graph("attention_check", input_types=types, custom_extensions=[kernels_path()]) as g:
        *cache, x, offsets, wqkv, freqs, layer = (v.tensor for v in g.inputs)
        kv = manager.collection_fetcher()(*cache)
        q = kvops.fused_qkv_ragged_matmul(params, x, offsets, wqkv, kv, layer)
        q = q.reshape(["tokens", heads, head_dim])
        q = kvops.fused_qk_ragged_rope(params, q, offsets, kv, freqs, layer, interleaved=False)
        g.output(q, kvops.flash_attention_ragged(params, q, offsets, kv, layer))
    return session.load(g)


def check(
    kind: str, shape: tuple[int, int, int, int], device: Device, weight_scale: float = 0.25
) -> dict[str, float]:
    """Largest |device - NumPy| per output (rotated Q, attention) over every step and layer."""
    heads, kv_heads, head_dim, hidden = shape
    session = InferenceSession(devices=[CPU(), device])
    manager = make_manager(kind, KVCacheParams(DType.float32, kv_heads, head_dim), device, session)
    start = time.perf_counter()
    model = build(manager, shape, session)
    print(f"{kind}: compiled in {time.perf_counter() - start:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    reference = ReferenceLayerCache()
    rows = (heads + 2 * kv_heads) * head_dim
    wqkv = [
        rng.standard_normal((rows, hidden)).astype(np.float32) * weight_scale for _ in range(LAYERS)
    ]
    freqs = kvops.rope_freqs_cis(head_dim, POSITIONS, THETA)
    seqs, worst = manager.claim(3), {"q": 0.0, "attention": 0.0}
    for new in STEPS:
        for layer in range(LAYERS):
            x = rng.standard_normal((sum(new), hidden)).astype(np.float32)
            offsets = np.concatenate([[0], np.cumsum(new)]).astype(np.uint32)
            (inputs,) = manager.fetch(seqs, active_lengths=new)
            outputs = model.execute(
                *inputs,
                *(Buffer.from_numpy(a).to(device) for a in (x, offsets, wqkv[layer], freqs)),
                Buffer.from_numpy(np.array(layer, dtype=np.uint32)),
            )
            expected = reference.step(
                layer, seqs, x, new, wqkv[layer], heads, kv_heads, head_dim, THETA, False
            )
            for name, got, want in zip(worst, outputs, expected[:2], strict=True):
                diff = np.abs(got.to(CPU()).to_numpy().reshape(want.shape) - want)
                worst[name] = max(worst[name], float(diff.max()))
        manager.step(dict(zip(seqs, new, strict=True)))
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    parser.add_argument("--cache", choices=["contiguous", "paged", "both"], default="both")
    parser.add_argument(
        "--weight-scale", type=float, default=0.25, help="random QKV weights' scale"
    )
    args = parser.parse_args()
    device: Device = Accelerator() if args.device == "gpu" else CPU()
    failed = False
    for kind in ("contiguous", "paged") if args.cache == "both" else (args.cache,):
        try:
            worst = check(kind, SHAPES[args.shape], device, args.weight_scale)
            diffs = ", ".join(f"{name} {value:.2e}" for name, value in worst.items())
            print(f"{kind}: max |{args.device} - numpy|: {diffs}", flush=True)
        except Exception:  # report every cache kind, then fail
            traceback.print_exc()
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
