# maxkv's KV-cache ops: the opaque collections (contiguous and paged), their
# ctors, the bounds checks, and the ops over them (QKV projection and RoPE into
# the cache, flash and decode attention, stores, copies, diagnostics).
