"""What this machine can do, measured in the same run as the benchmarks.

- Memory read bandwidth: a 512 MiB float32 tensor summed by the
  ``maxkv.stream_read`` op, one contiguous chunk per CPU worker (what a
  kernel that streams weights or a KV cache can reach); bytes / median time.
- Matmul FLOP rate: NumPy's float32 GEMM (its BLAS, all threads) on
  2048 x 2048 x 2048; 2 N^3 / median time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from max.driver import Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType, ops

from maxkv.kernels import compiled_package

from .timing import median_seconds

#: The benchmarks' own Mojo ops (``maxkv.stream_read``), not shipped in the wheel.
BENCH_OPS = Path(__file__).resolve().parents[1] / "mojo_bench"

_READ_BYTES = 512 * 2**20


def read_bandwidth_gbps(
    session: InferenceSession, device: Device, workers: int, *, repeats: int = 9
) -> float:
    """GB/s of reading a 512 MiB float32 tensor once (see the module docstring)."""
    n = _READ_BYTES // 4
    ref = DeviceRef.from_device(device)
    with Graph(
        "maxkv_stream_read",
        input_types=[TensorType(DType.float32, [n], ref)],
        custom_extensions=[compiled_package(BENCH_OPS)],
    ) as graph:
        graph.output(
            ops.custom(
                "maxkv.stream_read",
                device=ref,
                values=[graph.inputs[0].tensor],
                out_types=[TensorType(DType.float32, [workers], ref)],
            )[0].tensor
        )
    model = session.load(graph)
    data = Buffer.from_numpy(np.ones(n, np.float32)).to(device)
    seconds = median_seconds(lambda: model.execute(data), warmup=2, repeats=repeats)
    return _READ_BYTES / seconds / 1e9


def matmul_gflops(*, size: int = 2048, repeats: int = 7) -> float:
    """GFLOP/s of NumPy's float32 GEMM on ``size`` cubed."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    seconds = median_seconds(lambda: a @ b, warmup=2, repeats=repeats)
    return 2 * size**3 / seconds / 1e9


def device_read_graph(device: DeviceRef, gib: float) -> Graph:
    """:func:`device_read_bandwidth_gbps`' graph: row sums of float32 ``[rows, 4096]``
    (``gib`` GiB)."""
    cols = 4096
    rows = max(1, int(gib * 2**30) // (4 * cols))
    with Graph("device_read", input_types=[TensorType(DType.float32, [rows, cols], device)]) as g:
        g.output(ops.sum(g.inputs[0].tensor, axis=-1))
    return g


def device_read_bandwidth_gbps(
    session: InferenceSession, device: Device, *, gib: float = 2.0, repeats: int = 9
) -> float:
    """GB/s of MAX's own row sum reading a float32 ``[rows, 4096]`` tensor of ``gib``
    GiB once, on any device (a GPU's HBM; the decode-attention goal's yardstick)."""
    graph = device_read_graph(DeviceRef.from_device(device), gib)
    model = session.load(graph)
    rows, cols = (int(d) for d in graph.inputs[0].tensor.shape)
    data = Buffer.zeros([rows, cols], DType.float32, device=device)

    def read() -> None:
        model.execute(data)
        device.synchronize()

    seconds = median_seconds(read, warmup=2, repeats=repeats)
    return rows * cols * 4 / seconds / 1e9
