"""GTSRB reading and the batch loader over prepared arrays."""
