"""First check on a lent GPU machine (``gpu_machine.sh check``): MAX imports
with the carried packages, runs a graph on the GPU, and loads its pipelines'
registry and maxkv's architectures.  ``--device cpu`` runs it here."""

from __future__ import annotations

import sys
import time

import numpy as np


def main() -> int:
    start = time.perf_counter()
    import max.driver as driver
    import tokenizers
    import transformers
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import DeviceRef, Graph, TensorType

    print("transformers", transformers.__version__, "tokenizers", tokenizers.__version__)
    device = driver.CPU() if "--device" in sys.argv and "cpu" in sys.argv else driver.Accelerator()
    print("device", device)
    session = InferenceSession(devices=[device])
    ref = DeviceRef.from_device(device)
    with Graph("check", input_types=[TensorType(DType.float32, [4], ref)]) as graph:
        graph.output(graph.inputs[0].tensor * 2 + 1)
    model = session.load(graph)
    x = driver.Buffer.from_numpy(np.arange(4, dtype=np.float32)).to(device)
    out = model.execute(x)[0]
    assert isinstance(out, driver.Buffer)
    got = out.to(driver.CPU()).to_numpy()
    print("graph on the device:", got)
    assert np.array_equal(got, np.arange(4) * 2 + 1)
    from max.pipelines import PIPELINE_REGISTRY  # noqa: F401

    import maxkv.pipelines  # noqa: F401
    from maxkv.kernels import kernels_path

    print("kernels", kernels_path())
    print(f"check passed in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
