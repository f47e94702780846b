"""What users send, as the server sees it: the prepared test split's original files, whole (no box), decoded
and preprocessed by the server's own code (serve.protocol.decode_images, the same function objects). evaluate
and optimize measure served accuracy on this, so both see exactly what the API would."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.artifacts.prepared import PREPARED_DIR, read_manifest, read_test_files
from pipeline.errors import StageError


def served_test_inputs(prepared: Path = PREPARED_DIR) -> tuple[np.ndarray, np.ndarray] | None:
    """(float32 [N, 3, S, S] in [0, 1], int64 labels [N]) of the original test files, framed as the prepared
    manifest says the server frames a file; None when the prepared data keeps no original files (made by an
    older prepare, or a test's fake)."""
    from pipeline.preprocess import MAX_PIXELS
    from pipeline.serve.protocol import BadRequest, decode_images

    files = read_test_files(prepared)
    if not files:
        return None
    try:
        framing = read_manifest(prepared).served_framing()
        images = decode_images([(f.read_bytes(), None) for f in files], framing, MAX_PIXELS)
    except BadRequest as exc:
        raise StageError(f"an original test file cannot be decoded ({exc}); rerun `pipeline prepare`") from None
    return images, np.asarray([f.label for f in files], dtype=np.int64)
