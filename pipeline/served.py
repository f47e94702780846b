"""What users send, as the server sees it: the prepared test split's original files, whole (no box), decoded
and preprocessed by the server's own code (serve.protocol.decode_images, the same function objects). evaluate
and optimize measure served accuracy on this, so both see exactly what the API would."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.artifacts.prepared import PREPARED_DIR, ModelInput, read_manifest, read_test_files
from pipeline.errors import StageError


def served_test_input(prepared: Path = PREPARED_DIR, batch_size: int = 256) -> ModelInput | None:
    """The original test files, framed as the prepared manifest says the server frames a file, as ModelInput;
    None when the prepared data keeps no original files (made by an older prepare, or a test's fake). Decoded
    once, batch by batch, into an unnamed scratch file in $TMPDIR (uint8: a quarter of the float32 input, and
    lossless: the server's input is pixels / 255), so memory holds one batch whatever the split's size."""
    import tempfile

    from pipeline.preprocess import MAX_PIXELS
    from pipeline.serve.protocol import BadRequest, decode_images

    files = read_test_files(prepared)
    if not files:
        return None
    framing = read_manifest(prepared).served_framing()
    s = framing.size
    with tempfile.TemporaryFile(prefix="served-test-") as scratch:  # gone with the process, even after kill -9
        rows = np.memmap(scratch, dtype=np.uint8, mode="w+", shape=(len(files), s, s, 3))
    for start in range(0, len(files), batch_size):
        batch = files[start : start + batch_size]
        try:
            images = decode_images([(f.read_bytes(), None) for f in batch], framing, MAX_PIXELS)
        except BadRequest as exc:
            raise StageError(f"an original test file cannot be decoded ({exc}); rerun `pipeline prepare`") from None
        rows[start : start + len(batch)] = np.rint(images * np.float32(255)).astype(np.uint8).transpose(0, 2, 3, 1)
    return ModelInput.of_rows(rows, np.asarray([f.label for f in files], dtype=np.int64))
