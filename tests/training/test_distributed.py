"""train.amp: which precision `auto` picks, by device and CPU features; how many CPU threads a process takes."""

from __future__ import annotations

import pytest
import torch

from pipeline.training.distributed import amp_dtype

CPU = torch.device("cpu")


def test_auto_uses_bf16_on_cpus_with_bf16_arithmetic_and_fp32_elsewhere() -> None:
    expected = torch.bfloat16 if torch.backends.mkldnn.is_available() else None
    amx = {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}
    assert amp_dtype("auto", CPU, amx) is expected
    # AVX512-BF16 without the matrix units: measured 1.7x fp32 on an EPYC (`python -m benchmarks train`).
    assert amp_dtype("auto", CPU, {"avx2", "avx512f", "avx512_bf16"}) is expected
    # AVX2 (or AVX-512 without BF16) only emulates bf16: slower than fp32 there.
    assert amp_dtype("auto", CPU, {"avx2", "avx512f", "avx512_vnni"}) is None
    assert amp_dtype("auto", CPU, {"avx2", "fma"}) is None


def test_explicit_settings_win_over_the_machine() -> None:
    assert amp_dtype("off", CPU, {"amx_bf16"}) is None
    assert amp_dtype("bf16", CPU, {"avx2"}) is torch.bfloat16


def test_cpu_threads_split_the_usable_cpus_and_an_explicit_count_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.machine import usable_cpus
    from pipeline.training.distributed import cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_threads(0, 1) == usable_cpus() and cpu_threads(0, 2) == max(1, usable_cpus() // 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what a launcher or the user chose (torchrun sets 1)
    assert cpu_threads(0, 1) == 1 and cpu_threads(3, 1) == 3
