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
    lossless: the server's input is pixels / 255), written and read with plain file calls (no mapping, so the
    file's pages stay the kernel's cache, not this process's memory): memory holds one batch whatever the size."""
    import os
    import tempfile

    from pipeline.images.preprocess import MAX_PIXELS
    from pipeline.serve.protocol import BadRequest, decode_images

    files = read_test_files(prepared)
    if not files:
        return None
    framing = read_manifest(prepared).served_framing()
    s = framing.size
    # Unlinked at once: gone with the process, even after kill -9; open as long as the ModelInput that reads it.
    scratch = tempfile.TemporaryFile(prefix="served-test-")  # noqa: SIM115
    for start in range(0, len(files), batch_size):
        batch = files[start : start + batch_size]
        try:
            images = decode_images([(f.read_bytes(), None) for f in batch], framing, MAX_PIXELS)
        except BadRequest as exc:
            scratch.close()
            raise StageError(f"an original test file cannot be decoded ({exc}); rerun `pipeline prepare`") from None
        scratch.write(np.rint(images * np.float32(255)).astype(np.uint8).transpose(0, 2, 3, 1).tobytes())
    scratch.flush()
    row_bytes = s * s * 3

    def rows(start: int, stop: int) -> np.ndarray:
        out = np.empty((stop - start, s, s, 3), dtype=np.uint8)
        if os.preadv(scratch.fileno(), [out.data], start * row_bytes) != out.nbytes:
            raise StageError(f"the scratch copy of the decoded test files in {tempfile.gettempdir()} ended early")
        return out

    return ModelInput(rows, np.asarray([f.label for f in files], dtype=np.int64))
