"""Decode, frame and resize many image files on every core, in order, with bounded memory (prepare's reader).

Worker processes, not threads: PIL releases the GIL while it decodes and resizes, but the framing around it
does not. On this 2-core machine both took the same time (17,200 JPEGs at 224 px: 26.0 s with threads, 25.6 and
26.1 s with processes, `python -m benchmarks memory -- pipeline prepare`): there the main process's writing and hashing
of the shards is the limit; processes are the choice that can use more cores where there are more.
The workers start from a fork server that imports only this module's light dependencies (numpy, PIL), not
the stage's (MLflow), and are sent chunks of files; at most a few chunks per worker are in flight, so memory
does not grow with the data.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor

import numpy as np

from pipeline.data.listing import SignFile
from pipeline.images.preprocess import BadImage, Framing, peek_image

CHUNK = 64  # files per task: amortises the round trip (~0.1 ms) over many decodes


def _decode_chunk(files: Sequence[SignFile], framing: Framing, use_box: bool) -> list[np.ndarray | str]:
    out: list[np.ndarray | str] = []
    for file in files:
        try:
            box = file.box if use_box else None
            with peek_image(str(file.path)) as image:
                out.append(framing.decode(image, box))
        except BadImage as exc:
            out.append(str(exc))
    return out


def decoded(
    files: Sequence[SignFile], framing: Framing, use_box: bool, workers: int | None = None
) -> Iterator[np.ndarray | str]:
    """Each file's array (uint8 [S, S, 3]) or why it cannot be read, in the files' order."""
    workers = workers or os.cpu_count() or 1
    chunks = [files[i : i + CHUNK] for i in range(0, len(files), CHUNK)]
    if workers == 1 or len(chunks) <= 1:  # not worth starting processes
        for chunk in chunks:
            yield from _decode_chunk(chunk, framing, use_box)
        return
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        pending: deque[Future[list[np.ndarray | str]]] = deque()
        for chunk in chunks:
            pending.append(pool.submit(_decode_chunk, chunk, framing, use_box))
            if len(pending) >= 3 * workers:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()
