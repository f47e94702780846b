"""The measurement lab: the tools behind docs/results.md (peers, formats, front ends, decoders, memory, GPU).

Beside the product, not in it: `python -m benchmarks --help` from a checkout; nothing in `pipeline/` imports it.
"""
