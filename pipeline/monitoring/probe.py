"""`pipeline monitor`: probe a running server (the deployed one, or any `pipeline serve`) as its users do.

Sends real labelled test images as PNG files to `POST /v1/predict` (`monitor.batch_size` per request,
`monitor.concurrency` requests in flight), measures accuracy, request latency (p50/p90/p99, client side) and
error rate, scrapes `/metrics` before and after for the server's own request and error counters, and checks
the thresholds in params.yaml (`monitor.*`). Writes reports/monitor/report.json and summary.md (the job
summary / alert issue body), prints a table, and fails with one line naming every breach.

Not a DVC stage: it probes a deployment, so the scheduled monitor workflow (and anyone, by hand) runs it.
Needs only numpy, Pillow and prometheus-client besides the package's config: no torch.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.artifacts import REPORTS_DIR
from pipeline.artifacts.prepared import MANIFEST_FILE, PREPARED_DIR, read_split, read_test_files
from pipeline.config import MONITOR_URL_ENV, MonitorConfig, Params
from pipeline.console import log
from pipeline.errors import StageError
from pipeline.serve.client import encode, http, multipart, top1

REPORT_DIR = REPORTS_DIR / "monitor"
COUNTERS = ("inference_requests", "inference_errors")  # the server's Prometheus counters (pipeline/serve/metrics.py)


@dataclass
class Answer:
    """One /v1/predict request: which images, how long, and what came back."""

    start: int
    count: int
    seconds: float
    status: int  # HTTP status; 0 when there was no answer (timeout, refused, dropped)
    predictions: list[int] | None = None
    error: str | None = None


def resolve_url(config: MonitorConfig, url: str | None = None) -> str:
    """--url, else $PIPELINE_MONITOR_URL, else monitor.url; a bare host:port gets http://."""
    chosen = url or os.environ.get(MONITOR_URL_ENV) or config.url
    if not chosen:
        raise StageError(f"no server to probe: pass --url URL, set {MONITOR_URL_ENV} or monitor.url in params.yaml")
    if "://" not in chosen:
        chosen = f"http://{chosen}"
    return chosen.rstrip("/")


def labelled_images(params: Params) -> tuple[list[bytes], np.ndarray]:
    """Encoded image files and their labels from `monitor.source`, the first `monitor.images` of them:
    `files` = the prepared test split's original files, whole (what users send); `raw` = the test split data.source
    lists under data.root, whole; `prepared` = the prepared crops (ROI + margin, resized) as PNG."""
    from PIL import Image

    config = params.monitor
    limit = config.images or None
    if config.source == "files":
        originals = read_test_files(PREPARED_DIR)[:limit]
        if not originals:
            raise StageError(
                f"{PREPARED_DIR} keeps no original test files: run `pipeline prepare` (or `dvc pull`), "
                "or use monitor.source: raw"
            )
        files, targets = [], []
        for original in originals:
            with Image.open(original.path) as image:
                files.append(encode(image, "png"))
            targets.append(original.label)
    elif config.source == "prepared":
        path = PREPARED_DIR / MANIFEST_FILE
        if not path.is_file():
            raise StageError(f"{path} not found: run `pipeline prepare` (or `dvc pull`), or use monitor.source: raw")
        test = read_split("test", PREPARED_DIR, head=limit)  # only what is sent is read
        files = [encode(image, "png") for image in test.images]
        targets = test.labels.tolist()
    else:
        from pipeline.data.sources import lister
        from pipeline.images.preprocess import BadImage, open_image

        listed = lister(params.data.source)(params.data.resolved_root(), False).test
        if listed is None:
            raise StageError(
                f"data.source {params.data.source} has no test split of its own: use monitor.source: files"
            )
        files, targets = [], []
        for file in listed[:limit]:
            try:
                files.append(encode(open_image(str(file.path)), "png"))
            except BadImage:
                continue  # the prepare stage skips unreadable files too
            targets.append(file.label)
    if not files:
        raise StageError(f"no labelled images to send (monitor.source: {config.source})")
    return files, np.asarray(targets, dtype=np.int64)


def scrape(url: str, timeout_s: float) -> dict[str, Any]:
    """The server's request and error counters from /metrics: {"available", "counters": {name: {labels: value}}}."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        status, _, body = http("GET", f"{url}/metrics", timeout_s=timeout_s)
    except StageError as exc:
        return {"available": False, "error": str(exc)}
    if status != 200:
        return {"available": False, "error": f"GET /metrics: HTTP {status}"}
    counters: dict[str, dict[str, float]] = {name: {} for name in COUNTERS}
    try:
        for family in text_string_to_metric_families(body.decode("utf-8", "replace")):
            if family.name not in counters:
                continue
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                    counters[family.name][key] = float(sample.value)
    except ValueError as exc:
        return {"available": False, "error": f"GET /metrics: not Prometheus text ({exc})"}
    return {"available": True, "counters": counters}


def _delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, float]]:
    if not (before.get("available") and after.get("available")):
        return {}
    return {
        name: {
            key: value - before["counters"][name].get(key, 0.0)
            for key, value in after["counters"][name].items()
            if value - before["counters"][name].get(key, 0.0)
        }
        for name in COUNTERS
    }


def _labels(key: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in key.split(",") if "=" in part)


def server_summary(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the server itself counted: totals since it started, and the change during the probe."""
    if not after.get("available"):
        return {"available": False, "error": after.get("error", "")}
    requests = after["counters"]["inference_requests"]
    total = sum(requests.values())
    failed = sum(v for k, v in requests.items() if not _labels(k).get("status", "").startswith("2"))
    delta = _delta(before, after)
    predict = [v for k, v in delta.get("inference_requests", {}).items() if _labels(k).get("route") == "/v1/predict"]
    return {
        "available": True,
        "requests_total": total,
        "failed_requests_total": failed,
        "error_rate_since_start": failed / total if total else 0.0,
        "errors_total": after["counters"]["inference_errors"],
        "during_probe": delta,
        "predict_requests_during_probe": sum(predict),
    }


def _send(url: str, images: list[bytes], start: int, timeout_s: float) -> Answer:
    body, content_type = multipart(images, "png")
    started = time.perf_counter()
    try:
        status, _, answer = http("POST", f"{url}/v1/predict", body, {"Content-Type": content_type}, timeout_s)
    except StageError as exc:
        return Answer(start, len(images), time.perf_counter() - started, 0, error=str(exc))
    seconds = time.perf_counter() - started
    if status != 200:
        return Answer(
            start, len(images), seconds, status, error=f"HTTP {status}: {answer[:200].decode('utf-8', 'replace')}"
        )
    try:
        predictions = top1(answer)
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return Answer(start, len(images), seconds, status, error=f"unreadable answer: {exc}")
    if len(predictions) != len(images):
        return Answer(
            start, len(images), seconds, status, error=f"{len(predictions)} predictions for {len(images)} images"
        )
    return Answer(start, len(images), seconds, status, predictions)


def probe(url: str, images: list[bytes], labels: np.ndarray, config: MonitorConfig) -> dict[str, Any]:
    """Send every image once; the client-side measurements."""
    starts = range(0, len(images), config.batch_size)
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=config.concurrency) as pool:
        answers = list(pool.map(lambda s: _send(url, images[s : s + config.batch_size], s, config.timeout_s), starts))
    seconds = time.perf_counter() - started
    ok = [a for a in answers if a.predictions is not None]
    correct = sum(int(p == labels[a.start + i]) for a in ok for i, p in enumerate(a.predictions or []))
    answered = sum(a.count for a in ok)
    latencies = np.asarray([a.seconds * 1000 for a in answers]) if answers else np.zeros(1)
    errors = [a for a in answers if a.predictions is None]
    by_status: dict[str, int] = {}
    for a in answers:
        by_status[str(a.status)] = by_status.get(str(a.status), 0) + 1
    return {
        "images_sent": len(images),
        "requests": len(answers),
        "requests_by_status": by_status,
        "errors": len(errors),
        "error_rate": len(errors) / len(answers) if answers else 0.0,
        "error_examples": sorted({a.error or "" for a in errors})[:3],
        "answered_images": answered,
        "correct": correct,
        "accuracy": correct / answered if answered else 0.0,
        "latency_ms": {
            "p50": float(np.percentile(latencies, 50)),
            "p90": float(np.percentile(latencies, 90)),
            "p99": float(np.percentile(latencies, 99)),
            "max": float(latencies.max()),
            "mean": float(latencies.mean()),
        },
        "seconds": seconds,
        "images_per_second": answered / seconds if seconds > 0 else 0.0,
    }


def breaches(result: dict[str, Any], server: dict[str, Any], config: MonitorConfig) -> list[str]:
    found: list[str] = []
    if result["answered_images"] == 0:
        found.append("no request was answered")
    elif result["accuracy"] < config.min_accuracy:
        found.append(f"accuracy {result['accuracy']:.4f} < monitor.min_accuracy {config.min_accuracy}")
    p99 = result["latency_ms"]["p99"]
    if p99 > config.max_p99_latency_ms:
        found.append(f"p99 latency {p99:.1f} ms > monitor.max_p99_latency_ms {config.max_p99_latency_ms}")
    if result["error_rate"] > config.max_error_rate:
        found.append(
            f"error rate {result['error_rate']:.4f} ({result['errors']}/{result['requests']} requests) > "
            f"monitor.max_error_rate {config.max_error_rate}"
        )
    if not server.get("available"):
        found.append(f"/metrics unavailable ({server.get('error', '')})")
    return found


def summary_markdown(report: dict[str, Any]) -> str:
    r, s, t = report["probe"], report["server"], report["thresholds"]
    status = "OK" if report["ok"] else "BREACH"
    lines = [
        f"### Monitor: {status} — {report['url']}",
        "",
        f"{report['time']}; model {report['model'].get('version', '?')} ({report['model'].get('variant', '?')}); "
        f"{r['images_sent']} labelled images ({report['source']}) in {r['requests']} requests, "
        f"{report['batch_size']} per request, {report['concurrency']} in flight.",
        "",
        "| check | value | threshold | |",
        "|---|---|---|---|",
        f"| accuracy | {r['accuracy']:.4f} ({r['correct']}/{r['answered_images']}) | ≥ {t['min_accuracy']} | "
        f"{'ok' if r['answered_images'] and r['accuracy'] >= t['min_accuracy'] else '**breach**'} |",
        f"| p99 latency | {r['latency_ms']['p99']:.1f} ms (p50 {r['latency_ms']['p50']:.1f} ms) | "
        f"≤ {t['max_p99_latency_ms']} ms | {'ok' if r['latency_ms']['p99'] <= t['max_p99_latency_ms'] else '**breach**'} |",
        f"| error rate | {r['error_rate']:.4f} ({r['errors']}/{r['requests']}) | ≤ {t['max_error_rate']} | "
        f"{'ok' if r['error_rate'] <= t['max_error_rate'] else '**breach**'} |",
    ]
    if s.get("available"):
        lines.append(
            f"| server: failed requests since start | {s['failed_requests_total']:.0f}/{s['requests_total']:.0f} "
            f"({s['error_rate_since_start']:.4f}) | | |"
        )
        lines.append(
            f"| server: /v1/predict requests during the probe | {s['predict_requests_during_probe']:.0f} | | |"
        )
    else:
        lines.append(f"| server /metrics | unavailable: {s.get('error', '')} | available | **breach** |")
    if report["breaches"]:
        lines += ["", "Breaches:", *(f"- {b}" for b in report["breaches"])]
    if r["error_examples"]:
        lines += ["", "Errors seen:", *(f"- `{e}`" for e in r["error_examples"])]
    return "\n".join(lines) + "\n"


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    r, s = report["probe"], report["server"]
    table = Table(title=f"monitor {report['url']}: {'OK' if report['ok'] else 'BREACH'}")
    table.add_column("check")
    table.add_column("value", justify="right")
    table.add_row("images / requests", f"{r['images_sent']} / {r['requests']}")
    table.add_row("accuracy", f"{r['accuracy']:.4f}")
    table.add_row("latency p50 / p99 ms", f"{r['latency_ms']['p50']:.1f} / {r['latency_ms']['p99']:.1f}")
    table.add_row("error rate", f"{r['error_rate']:.4f}")
    table.add_row("images/s", f"{r['images_per_second']:.0f}")
    if s.get("available"):
        table.add_row("server failed / total requests", f"{s['failed_requests_total']:.0f} / {s['requests_total']:.0f}")
    else:
        table.add_row("server /metrics", "unavailable")
    Console().print(table)


def run(params: Params, url: str | None = None) -> dict[str, Any]:
    config = params.monitor
    base = resolve_url(config, url)
    images, labels = labelled_images(params)
    # Reachable at all? One clear line instead of N identical request errors.
    try:
        status, _, _ = http("GET", f"{base}/v2/health/ready", timeout_s=config.timeout_s)
    except StageError as exc:
        raise StageError(f"monitor: cannot reach the server at {base} ({exc})") from None
    ready = status == 200
    model: dict[str, Any] = {}
    status_meta, _, meta = http("GET", f"{base}/v2/models/{params.serve.model_name}", timeout_s=config.timeout_s)
    if status_meta == 200:
        try:
            info = json.loads(meta)
            model = {
                "version": (info.get("versions") or ["?"])[0],
                "variant": info.get("parameters", {}).get("variant"),
            }
        except ValueError:
            model = {}
    log(f"monitor: {base} ready={ready}; sending {len(images)} images, {config.batch_size} per request")
    before = scrape(base, config.timeout_s)
    result = probe(base, images, labels, config)
    after = scrape(base, config.timeout_s)
    server = server_summary(before, after)
    found = breaches(result, server, config)
    report: dict[str, Any] = {
        "url": base,
        "time": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "ok": not found,
        "breaches": found,
        "ready": ready,
        "ready_status": status,
        "model": model,
        "source": config.source,
        "batch_size": config.batch_size,
        "concurrency": config.concurrency,
        "thresholds": {
            "min_accuracy": config.min_accuracy,
            "max_p99_latency_ms": config.max_p99_latency_ms,
            "max_error_rate": config.max_error_rate,
        },
        "probe": result,
        "server": server,
    }
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    (REPORT_DIR / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (REPORT_DIR / "summary.md").write_text(summary_markdown(report))
    print_table(report)
    if found:
        raise StageError(f"monitor: {len(found)} threshold(s) breached at {base}: " + "; ".join(found))
    log(f"monitor: OK ({Path(REPORT_DIR / 'report.json')})")
    return report
