"""The CPU kernels of maxkv's model graph, and what they need on the host.

- :mod:`~maxkv.cpu.linear`: packed float32 matmuls and SwiGLU.
- :mod:`~maxkv.cpu.greedy_head`: the exact greedy next token from integer logits.
- :mod:`~maxkv.cpu.quantized`: exact block-quantized weight copies (GGUF blocks).
- :mod:`~maxkv.cpu.arrays`: arrays on cache-line boundaries.
- :mod:`~maxkv.cpu.features`: the host's CPU feature flags and usable cores.
"""
