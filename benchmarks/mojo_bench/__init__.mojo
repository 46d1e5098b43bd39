# Mojo ops for maxkv's benchmarks only (not in the wheel).
