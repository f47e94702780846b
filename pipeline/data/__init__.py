"""Data sources (sources.py's table), decoding, and the batch loader over prepared arrays."""
