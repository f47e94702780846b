"""`pipeline monitor --drift`: is the live traffic still what the model was tested on?

Reads the reference the served variant carries (GET /v1/drift-reference, or --reference FILE) and the live drift
signals (pipeline/monitoring/drift.py) from the server's /metrics, over `monitor.drift.window_s` (two scrapes that far apart;
0 = since the server started), or from a Prometheus server's query API (--prometheus URL: `increase(...[window])`,
summed over every replica). Compares each signal (confidence, brightness, width, height, aspect, class) with
`drift.compare`, prints a table, writes reports/monitor/drift.json and drift.md (the job summary / alert issue body),
and fails with one line naming each drifted signal.

Needs numpy, scipy, prometheus-client and the package's config: no torch (the monitor workflow's light env).
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.parse
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pipeline.artifacts import drift_reference
from pipeline.config import Params
from pipeline.console import log
from pipeline.errors import StageError
from pipeline.monitoring import drift
from pipeline.monitoring.probe import REPORT_DIR, resolve_url
from pipeline.serve.client import http


def fetch_reference(base: str, timeout_s: float, path: Path | None) -> Any:
    if path is not None:
        return drift_reference.read(path)
    status, _, body = http("GET", f"{base}/v1/drift-reference", timeout_s=timeout_s)
    if status != 200:
        detail = ""
        with contextlib.suppress(ValueError):
            detail = json.loads(body).get("error", "")
        raise StageError(
            f"monitor --drift: {base}/v1/drift-reference answered {status}{f' ({detail})' if detail else ''}; "
            "serve a model evaluated by this version, or pass --reference reports/evaluate/drift_reference.json"
        )
    try:
        return drift_reference.DriftReference.model_validate_json(body)
    except ValueError as exc:
        raise StageError(f"monitor --drift: {base}/v1/drift-reference is not a drift reference ({exc})") from None


def scrape_signals(base: str, classes: list[str], timeout_s: float) -> drift.SignalCounts:
    status, _, body = http("GET", f"{base}/metrics", timeout_s=timeout_s)
    if status != 200:
        raise StageError(f"monitor --drift: {base}/metrics answered {status}")
    text = body.decode()
    if not any(s.metric in text for s in drift.SIGNALS.values()):
        raise StageError(f"monitor --drift: {base}/metrics has no drift signals (a server older than this version?)")
    return drift.parse_metrics(text, classes)


def query_prometheus(prometheus: str, classes: list[str], window_s: float, timeout_s: float) -> drift.SignalCounts:
    """The signals' increase over the window, summed over every scraped replica, from Prometheus' HTTP API."""
    window = f"{max(1, int(window_s or 3600))}s"
    base = prometheus.rstrip("/")
    if "://" not in base:
        base = f"http://{base}"

    def query(expr: str) -> list[dict[str, Any]]:
        url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        status, _, body = http("GET", url, timeout_s=timeout_s)
        try:
            answer = json.loads(body)
        except ValueError:
            answer = {}
        if status != 200 or answer.get("status") != "success":
            raise StageError(
                f"monitor --drift: Prometheus at {base} answered {status} to {expr!r}: {answer.get('error', '')}"
            )
        return list(answer["data"]["result"])

    counts = drift.SignalCounts(list(classes))
    for name, signal in drift.SIGNALS.items():
        by_le = {
            float(r["metric"]["le"]): float(r["value"][1])
            for r in query(f"sum by (le) (increase({signal.metric}_bucket[{window}]))")
        }
        if by_le:
            counts.buckets[name] = drift.from_cumulative(signal.edges, by_le)
        sums = query(f"sum(increase({signal.metric}_sum[{window}]))")
        counts.sums[name] = float(sums[0]["value"][1]) if sums else 0.0
    index = {c: i for i, c in enumerate(classes)}
    for r in query(f"sum by (class) (increase({drift.CLASS_METRIC}_total[{window}]))"):
        if r["metric"].get("class") in index:
            counts.class_counts[index[r["metric"]["class"]]] += round(float(r["value"][1]))
    return counts


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"### Drift: {report['url']} — {'OK' if report['ok'] else 'DRIFT'}",
        "",
        f"{report['live_images']} answered images ({report['window']}) against the reference: {report['reference']}.",
        "",
        "| signal | PSI | p-value | reference mean | live mean | drifted |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for s in report["signals"]:
        mean = lambda v: "" if v is None else f"{v:.3f}"  # noqa: E731
        lines.append(
            f"| {s['signal']} | {s['psi']:.3f} | {s['p_value']:.2g} | {mean(s['reference_mean'])} | "
            f"{mean(s['live_mean'])} | {'**yes**' if s['drifted'] else 'no'} |"
        )
    if report.get("note"):
        lines += ["", report["note"]]
    return "\n".join(lines) + "\n"


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"drift {report['url']}: {'OK' if report['ok'] else 'DRIFT'} ({report['live_images']} images)")
    for column in ("signal", "PSI", "p-value", "ref mean", "live mean", "drifted"):
        table.add_column(column, justify="left" if column in ("signal", "drifted") else "right")
    for s in report["signals"]:
        mean = lambda v: "" if v is None else f"{v:.3f}"  # noqa: E731
        table.add_row(
            s["signal"], f"{s['psi']:.3f}", f"{s['p_value']:.2g}", mean(s["reference_mean"]), mean(s["live_mean"]),
            "YES" if s["drifted"] else "no",
        )  # fmt: skip
    Console().print(table)


def run(
    params: Params,
    url: str | None = None,
    prometheus: str | None = None,
    reference_path: Path | None = None,
    window_s: float | None = None,
) -> dict[str, Any]:
    config, timeout = params.monitor.drift, params.monitor.timeout_s
    window = config.window_s if window_s is None else window_s
    base = resolve_url(params.monitor, url)
    try:
        reference = fetch_reference(base, timeout, reference_path)
        expected = drift.from_reference(reference)
    except ValueError as exc:
        raise StageError(f"monitor --drift: {exc}") from None
    classes = list(reference.classes)
    if prometheus:
        live = query_prometheus(prometheus, classes, window, timeout)
        described = f"Prometheus {prometheus}, the last {int(window or 3600)} s"
    else:
        first = scrape_signals(base, classes, timeout)
        if window > 0:
            log(f"monitor --drift: counting {base}'s traffic for {window:.0f} s")
            time.sleep(window)
            live = scrape_signals(base, classes, timeout).minus(first)
            described = f"the last {window:.0f} s"
        else:
            live, described = first, "since the server started"
    images = sum(live.class_counts)
    found = drift.compare(expected, live, config.max_psi, config.max_p_value)
    drifted = [s for s in found if s.drifted]
    note = ""
    if images < config.min_images:
        note = f"Too little traffic to judge: {images} answered images, fewer than monitor.drift.min_images {config.min_images}."
        drifted = []
    report: dict[str, Any] = {
        "url": base,
        "time": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "ok": not drifted,
        "window": described,
        "reference": f"{reference.variant} {reference.model_version}, {reference.source}",
        "live_images": images,
        "thresholds": config.model_dump(),
        "drifted": [s.signal for s in drifted],
        "signals": [vars(s) | {"drifted": s.drifted and not note} for s in found],
        "note": note,
    }
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    (REPORT_DIR / "drift.json").write_text(json.dumps(report, indent=2) + "\n")
    (REPORT_DIR / "drift.md").write_text(markdown(report))
    print_table(report)
    if note:
        log(f"monitor --drift: {note}")
    if drifted:
        named = "; ".join(f"{s.signal} (PSI {s.psi:.2f}, p {s.p_value:.1g})" for s in drifted)
        raise StageError(f"monitor --drift: {len(drifted)} signal(s) drifted at {base}: {named}")
    log(f"monitor --drift: OK, no signal drifted ({REPORT_DIR / 'drift.json'})")
    return report
