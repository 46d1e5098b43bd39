# maxkv's CPU kernels for the model graph: packed float32 (and block-quantized)
# matmuls, SwiGLU, and the greedy head.
