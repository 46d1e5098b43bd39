# maxkv's Mojo custom ops, loaded as one MAX graph `custom_extensions` entry (this
# folder, or the `.mojoc` built from it by `maxkv.kernels_path()`):
#   kv/   the opaque KV-cache collections and the ops over them;
#   cpu/  the CPU kernels of maxkv's model graph.
