"""A walk through the maxkv step protocol, printing what the kernel sees.

    python examples/quickstart.py

claim -> fetch -> run a graph (ctor + cache_lengths op) -> increment_cache_lengths
-> step -> fetch -> release, on the CPU.  The first run compiles the Mojo
package and the graph (about a minute on two cores); later runs reuse both.
"""

from __future__ import annotations

import numpy as np
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import Graph

import maxkv
from maxkv import (
    ContinuousBatchingKVCacheManager,
    FetchContinuousBatchingKVCacheCollection,
    KVCacheParams,
)


def main() -> None:
    params = KVCacheParams(DType.float32, n_kv_heads=2, head_dim=16)
    session = InferenceSession(devices=[CPU()])
    manager = ContinuousBatchingKVCacheManager(
        params,
        max_cache_batch_size=4,
        max_seq_len=32,
        num_layers=2,
        devices=[CPU()],
        session=session,
    )

    print(
        "compiling the graph: blocks, cache_lengths, lookup_table, max_lengths -> "
        "ContinuousBatchingKVCacheCollection -> maxkv.ops.cache_lengths"
    )
    with Graph(
        "quickstart",
        input_types=manager.input_symbols()[0],
        custom_extensions=[maxkv.kernels_path()],
    ) as graph:
        collection = FetchContinuousBatchingKVCacheCollection(params)(
            *(value.tensor for value in graph.inputs)
        )
        graph.output(maxkv.ops.cache_lengths(params, collection))
    model = session.load(graph)

    def kernel_view(inputs: maxkv.KVCacheInputs) -> list[int]:
        return [int(x) for x in model.execute(*inputs)[0].to_numpy()]

    # 1. claim: three requests arrive.
    seq_ids = manager.claim(3)
    prompts = {seq_ids[0]: 5, seq_ids[1]: 9, seq_ids[2]: 1}
    print(f"claimed {seq_ids}; {manager.slots_remaining} slot(s) left")

    # 2. fetch: context encoding now, then 2 decode steps without host round trips.
    order = [seq_ids[2], seq_ids[0], seq_ids[1]]  # any batch order
    inputs = manager.fetch(order, num_steps=3, active_lengths=prompts)
    blocks, _lengths, lookup, max_lengths = inputs[0]
    print(
        f"fetch: blocks {list(blocks.shape)} {blocks.dtype}, lookup_table "
        f"{lookup.to_numpy().tolist()}, max_lengths rows {max_lengths.to_numpy().tolist()}"
    )
    print(f"  is_cache_empty (max_lengths[0, 1] == 0): {max_lengths.to_numpy()[0, 1] == 0}")

    # 3-4. run each step; advance the cache lengths on the device in between.
    new_tokens = [prompts[s] for s in order]
    for step in range(3):
        print(
            f"step {step}: kernel sees cache lengths {kernel_view(inputs[0])} "
            f"for seq ids {order}, {new_tokens} new token(s)"
        )
        offsets = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.uint32)
        if step < 2:
            inputs = manager.increment_cache_lengths(inputs, (None, Buffer.from_numpy(offsets)))
        new_tokens = [1, 1, 1]

    # 5. step: commit prompt + 2 generated tokens per sequence.
    manager.step({s: prompts[s] + 2 for s in seq_ids})
    print(f"committed: {dict(manager.cache_lengths)}")

    # 6. release one request; the others keep decoding.
    manager.release(seq_ids[1])
    inputs = manager.fetch([seq_ids[0], seq_ids[2]])
    print(
        f"after releasing {seq_ids[1]}: kernel sees {kernel_view(inputs[0])} for "
        f"{[seq_ids[0], seq_ids[2]]}; {manager.slots_remaining} slot(s) free"
    )

    try:
        manager.fetch([seq_ids[1]])
    except ValueError as error:
        print(f"fetching a released id is refused before any kernel runs: {error}")


if __name__ == "__main__":
    main()
