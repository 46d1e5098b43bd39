"""Device placement, checked by building graphs (no GPU needed, nothing compiles).

MAX 26.7's ``DeviceRef ==`` finds every device kind equal (``DeviceKind`` is a
frozen dataclass over a ``str`` enum), so a GPU graph once took maxkv's
CPU-only kernels and device mismatches went unnoticed; these tests pin the
placement decisions that an H100 run exposed.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType

from maxkv import FetchContinuousBatchingKVCacheCollection, KVCacheParams
from maxkv import ops as kvops
from maxkv.cache.spec import BATCH_DIM, CacheSpec
from maxkv.graph.checks import same_device
from maxkv.graph.types import layer_collections
from maxkv.models.config import default_llama
from maxkv.models.decoder import build_decoder_graph, cache_params

from .family_checkpoints import hf_family_config

GPU, CPU = DeviceRef.GPU(), DeviceRef.CPU()


@pytest.mark.unit
def test_same_device_tells_kinds_and_ids_apart() -> None:
    assert same_device(GPU, DeviceRef.GPU(0))
    assert same_device(CPU, DeviceRef.CPU())
    assert not same_device(GPU, CPU)
    assert not same_device(DeviceRef.GPU(0), DeviceRef.GPU(1))


def cache_types(params: KVCacheParams, layers: int, device: DeviceRef) -> list[TensorType]:
    blocks = ["slots", 2, layers, "seq", params.n_kv_heads_per_device, params.head_dim]
    return [
        TensorType(params.dtype, blocks, device),
        TensorType(DType.uint32, [BATCH_DIM], device),
        TensorType(DType.uint32, [BATCH_DIM], device),
        TensorType(DType.uint32, ["num_steps", 2], CPU),
    ]


@pytest.mark.compile
def test_a_gpu_llama_graph_uses_max_kernels_not_the_cpu_ones(kernels: Path) -> None:
    config, _ = default_llama()
    params = cache_params(config)
    types = cache_types(params, config.num_hidden_layers, GPU)
    spec = CacheSpec(params, config.num_hidden_layers)
    collections = functools.partial(layer_collections, spec)
    graph = build_decoder_graph(config, params, types, collections, GPU)
    text = str(graph)
    assert "maxkv.fused_qkv_ragged_matmul" in text
    for cpu_only in ("linear_packed", "store_kv_ragged", "swiglu", "greedy_head"):
        assert f"maxkv.{cpu_only}" not in text, cpu_only
    with pytest.raises(ValueError, match="greedy_head needs a CPU graph"):
        build_decoder_graph(config, params, types, collections, GPU, greedy_head=True)


@pytest.mark.compile
def test_cpu_only_ops_refuse_gpu_tensors(kernels: Path) -> None:
    params = KVCacheParams(DType.float32, 2, 16)
    int8 = KVCacheParams(DType.float32, 2, 16, cache_dtype="int8")
    (int8_types,) = CacheSpec(int8, 2).input_symbols([GPU])
    types = [
        TensorType(DType.float32, ["t", 32], GPU),
        TensorType(DType.float32, [4, 1, 32, 64], GPU),
        *cache_types(params, 2, GPU),
        *int8_types,
    ]
    with Graph("gpu_refusals", input_types=types, custom_extensions=[kernels]) as graph:
        x, w, *caches = (v.tensor for v in graph.inputs)
        cache, int8_cache = caches[:4], caches[4:]
        kv = FetchContinuousBatchingKVCacheCollection(params)(*cache)
        with pytest.raises(ValueError, match="linear_packed runs on CPU; x is on"):
            kvops.linear_packed(x, w, 64)
        # store_kv_ragged stores on a GPU too (a QKV bias, q/k norms), but rotates
        # on the CPU only, and keeps the model's dtype there.
        with pytest.raises(ValueError, match="rotates on the CPU only"):
            kvops.store_kv_ragged(params, x, x, kv, 0, freqs_cis=x)
        int8_kv = FetchContinuousBatchingKVCacheCollection(int8)(*int8_cache)
        with pytest.raises(ValueError, match="needs the cache in the model's dtype"):
            kvops.store_kv_ragged(int8, x, x, int8_kv, 0)


@pytest.mark.compile
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3"])
def test_families_with_a_bias_or_qk_norms_build_gpu_graphs_from_max_kernels(
    family: str, kernels: Path
) -> None:
    """A QKV bias or q/k norms sit between the projection and the cache: on a GPU
    the graph projects with MAX's matmul, stores K and V with ``store_kv_ragged``
    (GPU-capable) and rotates with MAX's RoPE, never a CPU-only op."""
    from maxkv.models.registry import registered_architectures

    read = next(f.read_hf for f in registered_architectures().values() if f.name == family)
    config = read(hf_family_config(family))
    assert config.qkv_bias or config.qk_norm
    params = cache_params(config, DType.bfloat16)
    types = cache_types(params, config.num_hidden_layers, GPU)
    spec = CacheSpec(params, config.num_hidden_layers)
    graph = build_decoder_graph(
        config, params, types, functools.partial(layer_collections, spec), GPU
    )
    text = str(graph)
    assert "maxkv.store_kv_ragged" in text and "maxkv.fused_qk_ragged_rope" in text
    assert "maxkv.fused_qkv_ragged_matmul" not in text
    for cpu_only in ("linear_packed", "store_kv_rope_ragged", "swiglu", "greedy_head"):
        assert f"maxkv.{cpu_only}" not in text, cpu_only


@pytest.mark.compile
def test_token_copies_are_emitted_on_the_gpu_with_a_host_range(kernels: Path) -> None:
    """fork / prefix reuse / copy-on-write copy rows on the cache's own device: the
    copy op sits on the GPU, its range stays a host tensor, and a range on the GPU
    is refused (the op reads it on the host)."""
    params = KVCacheParams(DType.float32, 2, 16)
    types = [
        *cache_types(params, 2, GPU),
        TensorType(DType.uint32, [2], CPU),
        TensorType(DType.uint32, [2], GPU),
    ]
    with Graph("gpu_copy", input_types=types, custom_extensions=[kernels]) as graph:
        *cache, host_range, device_range = (v.tensor for v in graph.inputs)
        kv = FetchContinuousBatchingKVCacheCollection(params)(*cache)
        copied = kvops.copy_tokens(params, kv, host_range)
        assert same_device(copied.device, GPU)
        with pytest.raises(ValueError, match="token_range"):
            kvops.copy_tokens(params, kv, device_range)
        graph.output(copied)
    assert "maxkv.copy_tokens" in str(graph)


@pytest.mark.unit
def test_cache_inputs_on_different_devices_are_refused() -> None:
    params = KVCacheParams(DType.float32, 2, 16)
    types = cache_types(params, 2, CPU)
    types[1] = TensorType(DType.uint32, [BATCH_DIM], GPU)
    with Graph("split_devices", input_types=types) as graph:
        with pytest.raises(ValueError, match="cache_lengths must be on the device of blocks"):
            FetchContinuousBatchingKVCacheCollection(params)(*(v.tensor for v in graph.inputs))


@pytest.mark.unit
def test_row_copies_are_refused_up_front_where_they_cannot_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fork, prefix caching and n > 1 copy cache rows: MAX's device work copies on
    every device, and a cache whose device work cannot (``copies_supported`` False,
    patched in here) refuses them with a clear error before anything changes."""
    from max.driver import CPU as HostCPU
    from max.engine import InferenceSession

    from maxkv import ContinuousBatchingKVCacheManager

    session = InferenceSession(devices=[HostCPU()])
    params = KVCacheParams(DType.float32, 2, 16)
    manager = ContinuousBatchingKVCacheManager(params, 4, 32, 2, [HostCPU()], session)
    assert manager.copies_supported
    monkeypatch.setattr(
        ContinuousBatchingKVCacheManager, "copies_supported", property(lambda self: False)
    )
    (seq,) = manager.claim(1)
    with pytest.raises(ValueError, match="fork copies cache rows, which this cache's device work"):
        manager.fork(seq)
    assert manager.cache_lengths == {seq: 0}  # nothing claimed for the child
    with pytest.raises(ValueError, match="prefix caching copies cache rows"):
        ContinuousBatchingKVCacheManager(
            params, 4, 32, 2, [HostCPU()], session, enable_prefix_caching=True
        )
