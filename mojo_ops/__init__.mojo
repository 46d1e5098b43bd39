# maxkv Mojo custom ops: the continuous-batching KV cache collection and the
# kernels that consume it.  Load this folder (or the `.mojoc` built from it by
# `maxkv.kernels_path()`) as a MAX graph `custom_extensions` entry.
