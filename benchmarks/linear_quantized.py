"""``linear_packed`` over float32 weights against its exact quantized copies alone, by rows.

    python benchmarks/linear_quantized.py --json benchmarks/results/linear_quantized_<isa>.json
    python benchmarks/linear_quantized.py --formats bfloat16,float16 --shapes llama3b.gate_up
    python benchmarks/linear_quantized.py --activations int8 --formats 4_32k,6_16k

For the matrices of a decode step of two real models (SmolLM2-135M's fused
gate/up ``[3072, 576]`` and down ``[576, 1536]``, Gemma 3 270M's ``[4096,
640]`` and ``[640, 2048]``), each copy format the kernel reads
(:class:`maxkv.cpu.quantized.PackedFormat`: 4-bit integers per 32 weights,
8-bit ones per 32 or per 16 with float32 scales; 4-bit per 32 and 6-bit per
16 with factored scales, GGUF's K-quants; a checkpoint's bfloat16 or float16
values), held alone as a model holds a GGUF's matrices
(past 8 rows dequantized in panels), is timed against the float32 weights at
1 to 64 rows, interleaved, medians of ``--repeats``; results are checked
equal bit for bit first.  ``--shapes llama3b.gate_up,llama3b.down`` adds
Llama 3.2 3B's MLP matrices (``[16384, 3072]``, ``[3072, 8192]``).  Printed
and saved: microseconds per call and the weight bytes each call streams per
microsecond (GB/s), with the machine's read bandwidth (``maxkv.stream_read``)
measured in the same run.  ``--activations int8`` times the integer formats'
int8 copies (``MAXKV_ACTIVATIONS=int8``: ``x`` quantized to int8 per block,
integer dot products) instead, their results checked within 1% of the float32
product's scale rather than equal.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import numpy as np
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType, Weight
from maxkv_bench.machine import read_bandwidth_gbps
from maxkv_bench.report import machine_info
from maxkv_bench.timing import interleaved_median_seconds

from maxkv import ops as kvops
from maxkv.cpu.quantized import (
    ACTIVATIONS,
    PACKED_FORMATS,
    BlockQuantized,
    Floats16,
    HeldMatrix,
    PackedFormat,
)
from maxkv.kernels import kernels_path

SHAPES = {
    "smollm2.gate_up": (3072, 576),
    "smollm2.down": (576, 1536),
    "gemma3.gate_up": (4096, 640),
    "gemma3.down": (640, 2048),
    "llama3b.gate_up": (16384, 3072),
    "llama3b.down": (3072, 8192),
    "llama3b.qkv": (5120, 3072),
    "llama3b.o": (3072, 3072),
    "llama3b.head": (128256, 3072),
}
DEFAULT_SHAPES = ("smollm2.gate_up", "smollm2.down", "gemma3.gate_up", "gemma3.down")
FORMATS = PACKED_FORMATS
ROWS = (1, 4, 8, 16, 32, 64)


def format_name(fmt: PackedFormat) -> str:
    """``4_32``, ``6_16k`` (factored), ``bfloat16``: a format as ``--formats`` names it."""
    return fmt.floating or f"{fmt.bits}_{fmt.block}{'k' if fmt.factored else ''}"


def random_copy(rng: np.random.Generator, n: int, k: int, fmt: PackedFormat) -> HeldMatrix:
    """float16 scales and offsets (factored: float16 factors, int8 multipliers): every
    product exact, as in a GGUF file; 16-bit floats: normal values rounded to the type."""
    if fmt.floating:
        values = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        if fmt.floating == "float16":
            return Floats16.of(values.astype(np.float16).astype(np.float32), "float16")
        return Floats16.of((values.view(np.uint32) & 0xFFFF0000).view(np.float32), "bfloat16")
    q = rng.integers(0, 1 << fmt.bits, (n, k), dtype=np.uint8)
    if fmt.factored:
        d = rng.uniform(0.0001, 0.001, (n, k // 256, 2)).astype(np.float16).astype(np.float32)
        m = rng.integers(-64, 64, (n, k // fmt.block, 2), dtype=np.int8)
        return BlockQuantized.factored(q, d, m, fmt.bits, fmt.block)
    blocks = k // fmt.block
    scale = rng.uniform(0.001, 0.05, (n, blocks)).astype(np.float16).astype(np.float32)
    offset = (rng.standard_normal((n, blocks)) * 0.1).astype(np.float16).astype(np.float32)
    return BlockQuantized(q, scale, offset, fmt.bits, fmt.block)


def build(
    session: InferenceSession, name: str, n: int, k: int, arrays: dict[str, np.ndarray]
) -> object:
    """A graph of one ``linear_packed`` over ``arrays``: ``w``, or ``q``/``sm`` alone."""
    device = DeviceRef.CPU()
    with Graph(
        name,
        input_types=[TensorType(DType.float32, ["m", k], device)],
        custom_extensions=[kernels_path()],
    ) as g:
        w = Weight("w", DType.float32, arrays["w"].shape, device) if "w" in arrays else None
        quantized = None
        if "q" in arrays:
            quantized = (
                Weight("q", DType.uint8, arrays["q"].shape, device),
                Weight("sm", DType.float32, arrays["sm"].shape, device),
            )
        g.output(kvops.linear_packed(g.inputs[0].tensor, w, n, quantized))
    return session.load(g, weights_registry=arrays)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"of {','.join(SHAPES)}")
    names = [format_name(f) for f in FORMATS]
    parser.add_argument("--formats", default=",".join(names), help=f"of {','.join(names)}")
    parser.add_argument("--activations", choices=ACTIVATIONS, default="float32")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="rows per call")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    formats = [f for f in FORMATS if format_name(f) in args.formats.split(",")]
    if args.activations == "int8":
        formats = [f for f in formats if not f.floating]
    session = InferenceSession(devices=[CPU()])
    bandwidth = read_bandwidth_gbps(session, CPU(), os.cpu_count() or 1)
    print(f"read bandwidth: {bandwidth:.1f} GB/s", flush=True)
    rng = np.random.default_rng(0)
    rows_out = []
    for shape_name in args.shapes.split(","):
        n, k = SHAPES[shape_name]
        for fmt in formats:
            if fmt.factored and k % 256:
                continue  # factored scales are per 256 weights (GGUF's K-quants)
            copy = random_copy(rng, n, k, fmt)
            weight = copy.dequantize()
            q, sm = copy.pack(args.activations)
            w = kvops.pack_linear_weight(weight)
            tag = f"{shape_name.replace('.', '_')}_{format_name(fmt)}"
            f32 = build(session, f"f32_{tag}", n, k, {"w": w})
            quant = build(session, f"q_{tag}", n, k, {"q": q, "sm": sm})
            f32_bytes, q_bytes = w.nbytes, q.nbytes + sm.nbytes
            for m in map(int, args.rows.split(",")):
                x = Buffer.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
                a = f32.execute(x)[0].to_numpy()  # type: ignore[attr-defined]
                b = quant.execute(x)[0].to_numpy()  # type: ignore[attr-defined]
                if args.activations == "float32":
                    assert np.array_equal(a, b), f"{shape_name} {fmt} M={m}: results differ"
                else:  # int8 activations: within 1% of the product's scale
                    assert np.abs(a - b).max() <= 0.01 * np.abs(a).max(), f"{shape_name} M={m}"
                calls = {
                    "f32": functools.partial(f32.execute, x),  # type: ignore[attr-defined]
                    "q": functools.partial(quant.execute, x),  # type: ignore[attr-defined]
                }
                times = interleaved_median_seconds(calls, warmup=3, repeats=args.repeats)
                row = {
                    "matrix": shape_name,
                    "shape": [n, k],
                    "format": {
                        "bits": fmt.bits,
                        "block": fmt.block,
                        "factored": fmt.factored,
                        "floating": fmt.floating,
                    },
                    "activations": args.activations,
                    "rows": m,
                    "float32_us": times["f32"] * 1e6,
                    "quantized_us": times["q"] * 1e6,
                    "speedup": times["f32"] / times["q"],
                    "float32_bytes": f32_bytes,
                    "quantized_bytes": q_bytes,
                    "float32_gbps": f32_bytes / times["f32"] / 1e9,
                    "quantized_gbps": q_bytes / times["q"] / 1e9,
                }
                rows_out.append(row)
                print(
                    f"{shape_name:16} {format_name(fmt):8} M={m:3}: "
                    f"f32 {row['float32_us']:8.1f} us, quantized {row['quantized_us']:8.1f} us "
                    f"({row['speedup']:.2f}x; {row['quantized_gbps']:.1f} GB/s of "
                    f"{q_bytes / 1e6:.2f} MB)",
                    flush=True,
                )
    results = {
        "machine": machine_info("cpu"),
        "read_bandwidth_gbps": bandwidth,
        "repeats": args.repeats,
        "rows": rows_out,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
