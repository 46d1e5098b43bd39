"""Where one decode step of a Llama on maxkv spends its time, by op family.

MAX has no per-op profiler on CPU, so each op family is compiled into small
graphs with the model's real shapes (weights of the same size, a cache
holding ``batch`` sequences of ``context`` tokens): one applying the op once
and one applying it 11 times (distinct weights, so nothing is merged and
weights stream from memory as in the model).  The difference over 10 is the
op's cost inside a graph, free of the fixed cost of an engine call; times the
calls a step makes, its share.  The full step is timed on the real model in the same run,
and host work between steps (cache inputs, buffers, reading tokens back) is
timed inside the scheduler.  What the parts do not add up to is reported as
"unattributed": op dispatch inside the graph, and fusion differences.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
from max.driver import Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef, Graph, TensorType, TensorValue, Weight, ops

from maxkv import (
    ContinuousBatchingKVCacheManager,
    FetchContinuousBatchingKVCacheCollection,
    kernels_path,
)
from maxkv import ops as kvops
from maxkv.cpu.arrays import aligned
from maxkv.cpu.quantized import BlockQuantized
from maxkv.models.blocks import matrix_of
from maxkv.models.config import DecoderConfig
from maxkv.models.decoder import DecoderModel, bfloat16_buffer, cache_params, graph_weights
from maxkv.serving.scheduler import ContinuousBatchingScheduler

from .timing import median_seconds


@dataclass(frozen=True)
class ProfileRow:
    """One op family's share of a decode step."""

    family: str
    calls_per_step: int
    ms_per_call: float

    @property
    def ms_per_step(self) -> float:
        return self.calls_per_step * self.ms_per_call


def _time(model: Model, inputs: list[Buffer], warmup: int, repeats: int) -> float:
    return median_seconds(lambda: model.execute(*inputs), warmup=warmup, repeats=repeats) * 1e3


class _Profiler:
    def __init__(
        self,
        session: InferenceSession,
        device: Device,
        config: DecoderConfig,
        batch: int,
        context: int,
        warmup: int,
        repeats: int,
    ) -> None:
        self.session, self.device, self.config = session, device, config
        self.batch, self.context = batch, context
        self.warmup, self.repeats = warmup, repeats
        self.ref = DeviceRef.from_device(device)
        self.rng = np.random.default_rng(0)

    def array(self, *shape: int) -> np.ndarray:
        return self.rng.standard_normal(shape).astype(np.float32)

    def buffer(self, *shape: int) -> Buffer:
        return Buffer.from_numpy(self.array(*shape)).to(self.device)

    def differential(
        self, name: str, build: Callable[[int], tuple[Graph, dict[str, np.ndarray], list[Buffer]]]
    ) -> float:
        """ms per op: (graph applying it 11 times - graph applying it once) / 10."""
        times = []
        for count in (1, 1 + _EXTRA):
            graph, weights, inputs = build(count)
            model = self.session.load(graph, weights_registry=weights)
            times.append(_time(model, inputs, self.warmup, self.repeats))
        return max(0.0, (times[1] - times[0]) / _EXTRA)

    def independent(
        self,
        name: str,
        shapes: list[list[int]],
        apply: Callable[[list[TensorValue], int], TensorValue],
        weight_shape: list[int] | None = None,
    ) -> float:
        """Per-call ms of ``apply(inputs_i, i)`` on ``count`` independent sets of inputs.

        Independent inputs keep MAX from fusing or merging the applications.
        """

        def build(count: int) -> tuple[Graph, dict[str, np.ndarray], list[Buffer]]:
            types = [
                TensorType(DType.float32, shape, self.ref) for _ in range(count) for shape in shapes
            ]
            weights = (
                {f"w{i}": self.array(*weight_shape) for i in range(count)} if weight_shape else {}
            )
            with Graph(
                f"profile_{name}_{count}", input_types=types, custom_extensions=[kernels_path()]
            ) as g:
                values = [v.tensor for v in g.inputs]
                n = len(shapes)
                g.output(*(apply(values[i * n : (i + 1) * n], i) for i in range(count)))
            return g, weights, [self.buffer(*shape) for _ in range(count) for shape in shapes]

        return self.differential(name, build)

    def weight(self, i: int, shape: list[int]) -> Weight:
        return Weight(f"w{i}", DType.float32, shape, self.ref)

    def bind(
        self,
        arrays: Mapping[str, np.ndarray],
        i: int,
        fresh: bool,
        registry: dict[str, np.ndarray],
    ) -> dict[str, Weight]:
        """Graph weights ``<part><i>`` of ``arrays`` (copies when ``fresh``), into ``registry``."""
        bound = {}
        for part, a in arrays.items():
            registry[f"{part}{i}"] = aligned(a, copy=True) if fresh else a
            bound[part] = Weight(f"{part}{i}", DType.from_numpy(a.dtype), a.shape, self.ref)
        return bound

    def linear(self, name: str, layers: list[dict[str, np.ndarray]], out_features: int) -> float:
        """Per-call ms of :func:`maxkv.ops.linear_packed` on the model's own matrices.

        ``layers``: per layer, ``{"w": packed}``, or ``"q"`` and ``"sm"``
        where the model holds the matrix as its quantized copy alone.
        Application *i* uses layer ``i % len(layers)``, a fresh copy of it
        when reused, so every application streams its own weights.
        """
        first = layers[0]
        in_features = int(first["w"].shape[2] if "w" in first else first["q"].shape[1])

        def build(count: int) -> tuple[Graph, dict[str, np.ndarray], list[Buffer]]:
            types = [TensorType(DType.float32, [self.batch, in_features], self.ref)]
            weights: dict[str, np.ndarray] = {}
            with Graph(
                f"profile_{name}_{count}", input_types=types, custom_extensions=[kernels_path()]
            ) as g:
                x = g.inputs[0].tensor
                outs = []
                for i in range(count):
                    w = self.bind(layers[i % len(layers)], i, i >= len(layers), weights)
                    quantized = (w["q"], w["sm"]) if "q" in w else None
                    outs.append(kvops.linear_packed(x, w.get("w"), out_features, quantized))
                g.output(*outs)
            return g, weights, [self.buffer(self.batch, in_features)]

        return self.differential(name, build)

    def greedy_head(self, head: dict[str, np.ndarray], vocab: int) -> float:
        """Per-call ms of :func:`maxkv.ops.greedy_head` (LM head and argmax in one).

        On normalized Gaussian rows: their logits are flatter than a real
        model's, so more tiles stay candidates and this errs on the slow side.
        """
        hidden = int(head["w"].shape[2])

        def build(count: int) -> tuple[Graph, dict[str, np.ndarray], list[Buffer]]:
            types = [TensorType(DType.float32, [self.batch, hidden], self.ref)]
            weights: dict[str, np.ndarray] = {}
            with Graph(
                f"profile_greedy_head_{count}",
                input_types=types,
                custom_extensions=[kernels_path()],
            ) as g:
                x = g.inputs[0].tensor
                outs = []
                for i in range(count):
                    w = self.bind(head, i, i > 0, weights)
                    outs.append(kvops.greedy_head(x, w["w"], w["q"], w["info"], vocab))
                g.output(*outs)
            return g, weights, [self.buffer(self.batch, hidden)]

        return self.differential("greedy_head", build)

    def cache_op(self, name: str, op: str) -> float:
        """Per-call ms of a cache op on one layer holding ``batch`` x ``context`` tokens."""
        c = self.config
        params = cache_params(c)
        manager = ContinuousBatchingKVCacheManager(
            params, self.batch, self.context + 2, 1, [self.device], self.session
        )
        q_width = c.num_attention_heads * c.head_dim
        qkv_width = q_width + 2 * c.num_key_value_heads * c.head_dim
        freqs = kvops.rope_freqs_cis(c.head_dim, self.context + 2, c.rope_theta)
        ids = manager.claim(self.batch)
        manager.step({i: self.context for i in ids})
        (inputs,) = manager.fetch(ids)
        offsets = Buffer.from_numpy(np.arange(self.batch + 1, dtype=np.uint32)).to(self.device)

        def build(count: int) -> tuple[Graph, dict[str, np.ndarray], list[Buffer]]:
            types = [
                *manager.input_symbols()[0],
                TensorType(DType.float32, ["tokens", qkv_width], self.ref),
                TensorType(DType.uint32, ["offsets"], self.ref),
            ]
            with Graph(
                f"profile_{name}_{count}", input_types=types, custom_extensions=[kernels_path()]
            ) as g:
                *cache, qkv, row_offsets = (v.tensor for v in g.inputs)
                kv = FetchContinuousBatchingKVCacheCollection(params)(*cache)
                table = Weight("freqs", DType.float32, freqs.shape, self.ref)
                outs = []
                for _ in range(count):
                    if op == "store_rope":  # as the model stores and rotates
                        outs.append(
                            kvops.store_kv_ragged(params, qkv, row_offsets, kv, 0, freqs_cis=table)
                        )
                        continue
                    q = qkv[:, :q_width].reshape(["tokens", c.num_attention_heads, c.head_dim])
                    outs.append(kvops.flash_attention_ragged(params, q, row_offsets, kv, 0))
                g.output(*outs)
            return g, {"freqs": freqs}, [*inputs, self.buffer(self.batch, qkv_width), offsets]

        try:
            return self.differential(name, build)
        finally:
            for i in ids:
                manager.release(i)


#: Extra applications of an op in the second graph of a differential timing.
_EXTRA = 10


def profile_decode_step(
    session: InferenceSession,
    device: Device,
    config: DecoderConfig,
    weights: Mapping[str, np.ndarray],
    prompts: list[list[int]],
    *,
    quantized: Mapping[str, BlockQuantized] | None = None,
    new_tokens: int = 32,
    num_steps: int = 4,
    warmup: int = 3,
    repeats: int = 15,
) -> dict[str, object]:
    """Profiles a decode step of ``config`` at batch ``len(prompts)``.

    The full step and the host work are measured by running the scheduler
    on ``prompts`` (``new_tokens`` each, no early stop: every request keeps
    decoding); the op families at the cache length reached halfway, the
    matmuls on the model's own matrices as the model holds them (with the
    quantized copies of ``quantized``, which steps of up to 8 rows read, and
    the greedy head where the model uses it).  The model's residual adds
    happen in the epilogues of the attention-output and down matmuls
    (``linear_packed(residual=)``), one load and add per output, which the
    matmul rows here leave out.

    Returns:
        ``{"batch", "context", "step_ms", "greedy_head", "rows": [{family,
        calls_per_step, ms_per_call, ms_per_step, share}], "unattributed_ms"}``.
    """
    c = config
    batch = len(prompts)
    context = int(np.mean([len(p) for p in prompts])) + new_tokens // 2
    manager = ContinuousBatchingKVCacheManager(
        cache_params(c),
        batch,
        max(len(p) for p in prompts) + new_tokens + num_steps,
        c.num_hidden_layers,
        [device],
        session,
    )
    model = DecoderModel(c, weights, manager, session, quantized=quantized)
    split = sorted(stem for stem in model.quant_formats if matrix_of(stem) != stem)
    if split:  # the rows below time one matmul per layer matrix
        raise ValueError(
            f"the profile times one matmul per layer matrix; this model holds {len(split)} "
            f"stacks in pieces of different formats ({split[0]}, ...)"
        )
    step_ms, host_ms = _measure_steps(model, manager, prompts, new_tokens, num_steps, repeats=3)
    registry = graph_weights(
        c, weights, packed=True, quantized=quantized, greedy_head=model.greedy_head
    )

    def matrices(names: list[str]) -> list[dict[str, np.ndarray]]:
        return [
            {
                part: registry[name + suffix]
                for part, suffix in (("w", ""), ("q", ".q"), ("sm", ".sm"))
                if name + suffix in registry
            }
            for name in names
        ]

    def layer_matrices(kind: str) -> list[dict[str, np.ndarray]]:
        return matrices([f"layers.{i}.{kind}" for i in range(min(layers, 1 + _EXTRA))])

    p = _Profiler(session, device, c, batch, context, warmup, repeats)
    h, layers = c.hidden_size, c.num_hidden_layers
    q_width = c.num_attention_heads * c.head_dim
    qkv = q_width + 2 * c.num_key_value_heads * c.head_dim
    inter = c.intermediate_size
    rows = [
        ProfileRow("matmul QKV", layers, p.linear("qkv", layer_matrices("wqkv"), qkv)),
        ProfileRow("matmul attention output", layers, p.linear("o", layer_matrices("wo"), h)),
        ProfileRow(
            "matmul gate+up", layers, p.linear("gate_up", layer_matrices("gate_up"), 2 * inter)
        ),
        ProfileRow("matmul down", layers, p.linear("down", layer_matrices("down"), h)),
    ]
    if model.greedy_head:
        head = {
            "w": registry["lm_head"],
            "q": registry["lm_head.greedy_q"],
            "info": registry["lm_head.greedy_info"],
        }
        rows.append(
            ProfileRow("LM head + argmax (greedy head)", 1, p.greedy_head(head, c.vocab_size))
        )
    else:
        rows.append(
            ProfileRow(
                "LM head (matmul)", 1, p.linear("lm_head", matrices(["lm_head"]), c.vocab_size)
            )
        )
    rows += [
        ProfileRow("store K/V + RoPE (one op)", layers, p.cache_op("store_rope", "store_rope")),
        ProfileRow("attention", layers, p.cache_op("attention", "attention")),
    ]
    rows += [
        ProfileRow(
            "RMSNorm",
            2 * layers + 1,
            p.independent(
                "norm",
                [[batch, h]],
                lambda v, i: ops.rms_norm(v[0], p.weight(i, [h]), epsilon=c.rms_norm_eps),
                weight_shape=[h],
            ),
        ),
        ProfileRow(
            "SwiGLU (silu x up)",
            layers,
            p.independent("swiglu", [[batch, 2 * inter]], lambda v, _: kvops.swiglu(v[0])),
        ),
    ]
    if not model.greedy_head:
        rows.append(
            ProfileRow(
                "sampling (argmax)",
                1,
                p.independent(
                    "argmax", [[batch, c.vocab_size]], lambda v, _: ops.argmax(v[0], axis=-1)
                ),
            )
        )
    rows.append(ProfileRow("host work between steps", 1, host_ms))
    attributed = sum(r.ms_per_step for r in rows)
    return {
        "batch": batch,
        "context": context,
        "step_ms": round(step_ms, 3),
        "greedy_head": model.greedy_head,
        "rows": [
            {
                "family": r.family,
                "calls_per_step": r.calls_per_step,
                "ms_per_call": round(r.ms_per_call, 4),
                "ms_per_step": round(r.ms_per_step, 3),
                "share": round(r.ms_per_step / step_ms, 3),
            }
            for r in rows
        ],
        "unattributed_ms": round(step_ms - attributed, 3),
    }


def _measure_steps(
    model: DecoderModel,
    manager: ContinuousBatchingKVCacheManager,
    prompts: list[list[int]],
    new_tokens: int,
    num_steps: int,
    repeats: int,
) -> tuple[float, float]:
    """(ms per decode step, host ms per step between graph executions)."""
    timed = _TimedModel(model)
    samples = []
    for _ in range(repeats + 1):  # the first run warms up
        scheduler = ContinuousBatchingScheduler(
            timed,  # type: ignore[arg-type]
            manager,
            len(prompts),
            num_steps,
            stop_at_eos=False,
        )
        for prompt in prompts:
            scheduler.submit(prompt, new_tokens)
        timed.reset()
        start = time.perf_counter()
        scheduler.run()
        wall = time.perf_counter() - start
        # Drop the prefill step: this profiles decoding.
        decode_exec = sum(timed.times[1:])
        steps = len(timed.times) - 1
        decode_wall = wall - timed.times[0]
        samples.append((decode_wall / steps, (decode_wall - decode_exec) / steps))
    step_s = float(np.median([s for s, _ in samples[1:]]))
    host_s = float(np.median([h for _, h in samples[1:]]))
    return step_s * 1e3, host_s * 1e3


class _TimedModel:
    """A :class:`DecoderModel` whose ``execute`` calls are timed (they block on CPU)."""

    def __init__(self, model: DecoderModel) -> None:
        self.model = model
        self.config = model.config
        self.device = model.device
        self.max_positions = model.max_positions
        self.times: list[float] = []

    def reset(self) -> None:
        self.times = []

    def execute(self, *args: object) -> Buffer:
        start = time.perf_counter()
        result = self.model.execute(*args)  # type: ignore[arg-type]
        result.to_numpy()  # wait for the step (a no-op copy on CPU)
        self.times.append(time.perf_counter() - start)
        return result


def matmul_dtypes(
    session: InferenceSession,
    device: Device,
    config: DecoderConfig,
    batches: list[int],
    *,
    warmup: int = 3,
    repeats: int = 15,
) -> list[dict[str, float | int | str]]:
    """ms of the model's two largest matmuls at each batch: MAX float32, MAX
    bfloat16 (weights and activations cast to bfloat16, output back to
    float32), and maxkv's packed float32 kernel.  Same data, same run."""
    c = config
    ref = DeviceRef.from_device(device)
    rng = np.random.default_rng(0)
    rows: list[dict[str, float | int | str]] = []
    for name, n, k in (
        ("LM head", c.vocab_size, c.hidden_size),
        ("gate+up", 2 * c.intermediate_size, c.hidden_size),
    ):
        w = rng.standard_normal((n, k), dtype=np.float32)
        models: dict[str, Model] = {}
        for variant in ("max_float32", "max_bfloat16", "maxkv_packed_float32"):
            shape = kvops.pack_linear_weight(w).shape if variant.startswith("maxkv") else (n, k)
            dtype = DType.bfloat16 if variant == "max_bfloat16" else DType.float32
            with Graph(
                f"dtype_{variant}_{n}",
                input_types=[TensorType(DType.float32, ["m", k], ref)],
                custom_extensions=[kernels_path()],
            ) as g:
                x = g.inputs[0].tensor
                weight = Weight("w", dtype, shape, ref)
                if variant == "maxkv_packed_float32":
                    y = kvops.linear_packed(x, weight, n)
                elif variant == "max_bfloat16":
                    y = ops.cast(ops.cast(x, DType.bfloat16) @ weight.T, DType.float32)
                else:
                    y = x @ weight.T
                g.output(y)
            registry: dict[str, object] = {
                "w": kvops.pack_linear_weight(w) if variant.startswith("maxkv") else w
            }
            if variant == "max_bfloat16":
                registry["w"] = bfloat16_buffer(w)
            models[variant] = session.load(g, weights_registry=registry)
        for batch in batches:
            x = Buffer.from_numpy(rng.standard_normal((batch, k), dtype=np.float32)).to(device)
            row: dict[str, float | int | str] = {
                "matmul": name,
                "shape": f"{n}x{k}",
                "batch": batch,
            }
            for variant, model in models.items():
                row[f"{variant}_ms"] = round(_time(model, [x], warmup, repeats), 3)
            rows.append(row)
    return rows
