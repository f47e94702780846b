"""reports/benchmark/profile.txt: where the chosen setup spends its time, by its backend's own profiler (the
record's `profiler`), else torch.profiler around its runtime's predict."""

from __future__ import annotations

import pkgutil
from pathlib import Path
from typing import Any

from pipeline.artifacts import MODELS_DIR
from pipeline.artifacts.prepared import read_split
from pipeline.benchmarking.setups import Setup
from pipeline.runtimes import RUNTIME_BACKENDS


def profile(setup: Setup, manifest: Any, out: Path) -> None:
    """Operator-level profile of the chosen setup, 20 batches of the first 32 test images."""
    batch = read_split("test", head=32).model_input()
    variant = next(v for v in manifest.variants if v.name == setup.variant)
    record = RUNTIME_BACKENDS.get(setup.backend)
    if record is not None and record.profiler:
        pkgutil.resolve_name(record.profiler)(MODELS_DIR / variant.file, batch, setup.label, out)
        return
    _torch_profile(setup, batch, out)


def _torch_profile(setup: Setup, batch: Any, out: Path) -> None:
    import torch

    from pipeline.runtimes import open_runtime

    runtime = open_runtime(MODELS_DIR, setup.variant, backend=setup.backend)
    runtime.predict(batch)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            runtime.predict(batch)
    out.write_text(
        f"torch.profiler: {setup.label}, 20 batches of 32\n\n"
        + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
        + "\n"
    )
