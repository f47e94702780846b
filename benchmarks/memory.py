"""Peak memory of a command: what a stage holds at its largest, measured from outside.

    uv run python -m benchmarks memory -- pipeline prepare
    uv run python -m benchmarks memory --seconds 600 --out reports/memory_train.json -- pipeline train

Runs the command, samples the resident memory (RSS) of it and of every process it starts every
`--interval` seconds, and prints: the kernel's own peak (`ru_maxrss` of the largest process, from wait4), the
peak of the sampled sum over the process tree, wall time, CPU use (user + system over wall, in cores) and the
sampled timeline's quartiles (a flat timeline is memory that does not grow with the data seen). With
`--seconds`, the command is stopped (SIGTERM, then SIGKILL) after that long: a training epoch on a large data
set runs for hours on a small machine, and its memory is flat after the first steps, which the timeline shows.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def tree_rss(pid: int) -> int:
    """Bytes resident in `pid` and its descendants now (anonymous and file pages, as RSS counts them)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            continue
        todo += _children(p)
    return total


def measure(command: list[str], seconds: float = 0.0, interval: float = 0.5) -> dict[str, object]:
    start = time.perf_counter()
    proc = subprocess.Popen(command)
    samples: list[tuple[float, int]] = []
    stopped_at: float | None = None
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)  # the only reaper: its rusage is the command's own
        if pid:
            break
        now = time.perf_counter() - start
        samples.append((round(now, 1), tree_rss(proc.pid)))
        if seconds and now > seconds and stopped_at is None:
            stopped_at = now
            proc.send_signal(signal.SIGTERM)
        elif stopped_at is not None and now > stopped_at + 30:
            proc.kill()
        time.sleep(interval)
    stopped = stopped_at is not None
    wall = time.perf_counter() - start
    own = usage.ru_maxrss * 1024  # kilobytes on Linux
    cpu = usage.ru_utime + usage.ru_stime
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # the largest descendant the command waited for
    rss = sorted(r for _, r in samples) or [0]
    return {
        "command": command,
        "exit_code": os.waitstatus_to_exitcode(status) if not stopped else None,
        "stopped_after_s": seconds if stopped else None,
        "wall_s": round(wall, 1),
        "cpu_cores_used": round(cpu / wall, 2) if wall else 0.0,
        "peak_rss_mib": round(max(own, children.ru_maxrss * 1024) / 2**20),
        "peak_tree_rss_mib": round(rss[-1] / 2**20),
        "rss_quartiles_mib": [round(rss[int(q * (len(rss) - 1))] / 2**20) for q in (0.25, 0.5, 0.75)],
        "timeline_mib": [(t, round(r / 2**20)) for t, r in samples[:: max(1, len(samples) // 40)]],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=0.0, help="stop the command after this long (0 = let it end)")
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command to measure after --")
    result = measure(command, args.seconds, args.interval)
    for key in ("wall_s", "cpu_cores_used", "peak_rss_mib", "peak_tree_rss_mib", "rss_quartiles_mib", "exit_code"):
        print(f"{key:>18}: {result[key]}")
    if result["stopped_after_s"]:
        print(f"{'stopped after':>18}: {result['stopped_after_s']} s (--seconds)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    code = result["exit_code"]
    sys.exit(code if isinstance(code, int) and code > 0 else 0)


if __name__ == "__main__":
    main()
