"""pipeline/images/served_input.py and prepared.ModelInput: what evaluate, optimize and benchmark feed the models, read a batch at
a time. The figures equal the whole split's in memory, value for value, while the memory held is a batch's."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np

from pipeline.artifacts.prepared import ModelInput, read_manifest, read_split, read_test_files
from pipeline.images.preprocess import MAX_PIXELS
from pipeline.images.served_input import served_test_input
from pipeline.serve.protocol import decode_images
from tests.helpers.prepared import write_prepared


def _peak_while_reading(images: ModelInput, batch_size: int) -> tuple[int, np.ndarray]:
    """The most numpy memory traced at once while every batch is read (each kept only as a checksum)."""
    sums = []
    tracemalloc.start()
    try:
        for batch in images.batches(batch_size):
            sums.append(batch.sum(axis=(1, 2, 3)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return peak, np.concatenate(sums)


def test_the_served_test_input_is_the_servers_tensor_a_batch_at_a_time(tmp_path: Path) -> None:
    """600 original test files at 64 px: the served input equals the server's own decode of every file, value
    for value, and reading it all holds under a quarter of the split as float32 (batches of 20 and their files)."""
    folder = write_prepared(tmp_path, sizes=(43, 43, 600), image_size=64, originals=True)
    files = read_test_files(folder)
    whole = decode_images([(f.read_bytes(), None) for f in files], read_manifest(folder).served_framing(), MAX_PIXELS)

    tracemalloc.start()
    try:
        served = served_test_input(folder, batch_size=20)  # decodes every file once, into a scratch file
        decode_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert served is not None and len(served) == 600
    assert np.array_equal(served.labels, [f.label for f in files])
    read_peak, sums = _peak_while_reading(served, 20)
    assert max(decode_peak, read_peak) < whole.nbytes / 4, (decode_peak, read_peak, whole.nbytes)
    assert np.array_equal(np.concatenate(list(served.batches(64))), whole)  # another batch size, the same values
    assert np.array_equal(sums, whole.sum(axis=(1, 2, 3)))
    assert np.array_equal(served.head(7), whole[:7])


def test_a_split_as_model_input_is_its_arrays_a_batch_at_a_time(tmp_path: Path) -> None:
    folder = write_prepared(tmp_path, sizes=(43, 43, 600), image_size=64, shard_mb=1)  # several shards
    whole = read_split("test", folder)
    images = ModelInput.of_split("test", folder)
    peak, sums = _peak_while_reading(images, 50)
    assert peak < whole.model_input().nbytes / 4, peak
    assert np.array_equal(sums, whole.model_input().sum(axis=(1, 2, 3)))
    assert np.array_equal(np.concatenate(list(images.batches(37))), whole.model_input())
    assert np.array_equal(images.labels, whole.labels)
    first = read_split("test", folder, head=10)  # deploy's and monitor's few images: only those are read
    assert np.array_equal(first.images, whole.images[:10]) and np.array_equal(first.labels, whole.labels[:10])
