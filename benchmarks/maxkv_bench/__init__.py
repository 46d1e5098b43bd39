"""Benchmarks of maxkv against MAX's paged KV cache and Hugging Face transformers.

Library code behind ``benchmarks/run.py``; every function returns plain
numbers (medians over repeated runs after warm-up) so the script can print,
save and plot them.
"""
