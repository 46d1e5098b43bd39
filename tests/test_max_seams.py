"""What maxkv relies on in MAX's behaviour, checked against the installed MAX.

Each test names the MAX behaviour and the maxkv code that depends on it, so a
MAX upgrade that changes it fails here, by name, rather than in a model.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType, Weight

pytestmark = pytest.mark.compile


def test_max_keeps_writable_weights_alive_but_not_read_only_ones() -> None:
    """``session.load(weights_registry=...)`` reads a CPU weight where it lies, holds
    a reference to a writable NumPy array and none to a read-only one.

    :func:`maxkv.kernels.load_graph` refuses read-only weights and
    :func:`maxkv.cpu.arrays.aligned` copies them because of this (a GGUF
    file's F32 tensors, read-only views of its mapping, were unmapped under
    the model: ``max generate`` died in its first step).  If this test fails
    because MAX now holds both, the refusal may be relaxed.
    """
    cpu = DeviceRef.CPU()
    with Graph("seam_weights", input_types=[TensorType(DType.float32, [4], cpu)]) as graph:
        writable_w = Weight("writable", DType.float32, [4], cpu)
        read_only_w = Weight("read_only", DType.float32, [4], cpu)
        graph.output(graph.inputs[0].tensor + writable_w + read_only_w)
    writable = np.arange(4, dtype=np.float32)
    read_only = np.full(4, 10, dtype=np.float32)
    read_only.flags.writeable = False
    before = sys.getrefcount(writable), sys.getrefcount(read_only)
    model = InferenceSession(devices=[CPU()]).load(
        graph, weights_registry={"writable": writable, "read_only": read_only}
    )
    held = sys.getrefcount(writable) - before[0], sys.getrefcount(read_only) - before[1]
    assert held == (1, 0), f"MAX now holds (writable, read-only) weights {held} times"
    writable[0] = 100  # read where it lies: no copy
    (out,) = model.execute(Buffer.from_numpy(np.zeros(4, np.float32)))
    np.testing.assert_array_equal(out.to_numpy(), [110, 11, 12, 13])
