"""The machine a stage runs on. Here: what machine and builds a measurement was taken on: CPU, ISA flags, cores,
library versions, and the BLAS / oneDNN / Arm Compute Library that the installed torch was built with (read from the
build, never assumed from the architecture: aarch64 wheels have shipped OpenBLAS and, later, NVPL). Beside it: how
much of it a stage may use (memory_budget.py: batch sizes within `memory_gb`) and its TCP ports (ports.py)."""

from __future__ import annotations

import math
import os
import platform
import re
from importlib import metadata
from pathlib import Path
from typing import Any

# ISA features that decide which kernels run: x86 vector/int8/bf16 extensions, Arm NEON/SVE/dot/bf16.
INTERESTING_FLAGS = (
    "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8",
    "asimd", "asimddp", "sve", "sve2", "bf16", "i8mm",
)  # fmt: skip


def own_peak_rss_mib() -> float:
    """This process's peak RSS since its exec (VmHWM; getrusage's ru_maxrss keeps the forking parent's); nan off Linux."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return float("nan")


def usable_cpus(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup CPU quota (a container's `--cpus`, a
    Kubernetes CPU limit) rounded up, and by OMP_NUM_THREADS when it is set (the thread count a user or a launcher
    chose: PyTorch honours it, so a stage does too). os.cpu_count() sees the whole node, and a runtime sizing its
    thread pool from that oversubscribes a 2-CPU pod on a 64-core node many times over."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota: float | None = None
    try:  # cgroup v2: "max 100000" or "<quota> <period>"
        limit, period = (cgroup_root / "cpu.max").read_text().split()[:2]
        if limit != "max":
            quota = int(limit) / int(period)
    except (OSError, ValueError):
        try:  # cgroup v1
            limit_us = int((cgroup_root / "cpu" / "cpu.cfs_quota_us").read_text())
            period_us = int((cgroup_root / "cpu" / "cpu.cfs_period_us").read_text())
            if limit_us > 0 and period_us > 0:
                quota = limit_us / period_us
        except (OSError, ValueError):
            pass
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota - 1e-9)))
    chosen = os.environ.get("OMP_NUM_THREADS", "").strip()
    if chosen.isdigit() and int(chosen) > 0:
        cpus = min(cpus, int(chosen))
    return max(1, cpus)


def _cpuinfo() -> tuple[str, set[str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown", set()
    model = "unknown"
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model", "hardware") and model == "unknown":
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
        elif key == "cpu part" and model == "unknown":
            model = f"Arm part {value.strip()}"
    return model, flags


def cpu_flags() -> set[str]:
    """CPU feature flags from /proc/cpuinfo (x86 `flags`, Arm `Features`); empty elsewhere."""
    return _cpuinfo()[1]


ARM_MACHINES = ("aarch64", "arm64", "armv8l")
X86_MACHINES = ("x86_64", "amd64", "i686", "x86")


def has_native_bf16(flags: set[str] | None = None, machine: str | None = None) -> bool:
    """bf16 arithmetic in hardware: AVX512-BF16 or AMX on x86, the BF16 extension on Arm."""
    flags = cpu_flags() if flags is None else flags
    machine = (machine or platform.machine()).lower()
    if machine in ARM_MACHINES:
        return "bf16" in flags
    return bool({"avx512_bf16", "amx_bf16"} & flags)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def torch_build() -> dict[str, Any]:
    """BLAS, oneDNN and ACL of the installed torch, from torch.__config__ (imports torch)."""
    import torch

    config = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=(\w+)", config)
    onednn = re.search(r"MKL-DNN v([\d.]+)", config) or re.search(r"oneDNN v([\d.]+)", config)
    acl = getattr(torch.backends.mkldnn, "is_acl_available", lambda: False)()
    return {
        "torch": torch.__version__,
        "blas": blas.group(1) if blas else "unknown",
        "onednn": onednn.group(1) if onednn else None,
        "onednn_available": bool(torch.backends.mkldnn.is_available()),
        "acl": bool(acl),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def facts(with_torch: bool = True) -> dict[str, Any]:
    model, flags = _cpuinfo()
    info: dict[str, Any] = {
        "architecture": platform.machine(),
        "cpu": model,
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "isa": sorted(f for f in INTERESTING_FLAGS if f in flags),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "onnxruntime": _version("onnxruntime"),
        "torchao": _version("torchao"),
    }
    if with_torch:
        info.update(torch_build())
    return info
