"""pipeline/machine/__init__.py: the CPUs a process may use, from its affinity and a cgroup CPU quota (v2 and v1)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.machine import usable_cpus

AFFINITY = len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"cpu.max": "max 100000\n"}, AFFINITY),  # v2, no limit
        ({"cpu.max": "100000 100000\n"}, 1),  # `docker run --cpus 1`, a 1-CPU pod limit
        ({"cpu.max": "50000 100000\n"}, 1),  # 500m: at least one thread
        ({"cpu.max": "150000 100000\n"}, min(2, AFFINITY)),  # 1.5 CPUs: rounded up, never above the mask
        ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),  # v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, AFFINITY),  # v1, no limit
        ({"cpu.max": "garbage"}, AFFINITY),  # unreadable: the mask
        ({}, AFFINITY),  # no cgroup files at all
    ],
)
def test_usable_cpus_follow_the_cgroup_quota(
    tmp_path: Path, files: dict[str, str], expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert usable_cpus(tmp_path) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1", 1), (str(AFFINITY + 8), AFFINITY), ("0", AFFINITY), ("four", AFFINITY), ("", AFFINITY)],
)
def test_omp_num_threads_caps_the_usable_cpus(
    tmp_path: Path, value: str, expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread count the user or a launcher set wins below the mask; nonsense is ignored, never an error."""
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert usable_cpus(tmp_path) == expected
