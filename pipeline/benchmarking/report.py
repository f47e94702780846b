"""reports/benchmark/ of one machine: report.json (facts, every result, the choice), table.md (the GitHub job
summary), results.csv (DVC plots), metrics.json (the headline), throughput.png; the served setup's headline figures
for MLflow; and `pipeline compare`, one table over several machines' reports."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pipeline.artifacts import REPORTS_DIR, benchmark_report
from pipeline.artifacts.benchmark_report import ONEDNN_OFF_EAGER
from pipeline.benchmarking.roofline import SGEMM_SIDE
from pipeline.benchmarking.setups import Result
from pipeline.config import BenchmarkConfig
from pipeline.runtimes import baseline_backend

REPORT_DIR = REPORTS_DIR / "benchmark"


def _fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def baseline_of(results: Sequence[dict[str, Any]], threads: int = 0) -> dict[str, Any] | None:
    """The fp32 eager oneDNN-off result at the same thread count (else the first eager one there)."""
    ok = [r for r in results if r["status"] == "ok" and r["setup"]["threads"] == threads]
    for r in ok:
        s = r["setup"]
        if (s["variant"], s["backend"], s["setting"]) == ONEDNN_OFF_EAGER:
            return r
    return next((r for r in ok if r["setup"]["backend"] == baseline_backend()), None)


def assemble(
    machine: dict[str, Any],
    config: BenchmarkConfig,
    manifest: Any,
    results: Sequence[Result],
    chosen: Result | None,
    rounds: dict[str, Any] | None,
    sgemm: dict[str, float],
    wall_s: float,
) -> dict[str, Any]:
    """report.json's content: the machine, the config, every result, the choice, the variants' work, the roofline and
    the headline's rounds."""
    return {
        "machine": machine,
        "config": config.model_dump(mode="json"),
        "wall_s": wall_s,
        "results": [r.record() for r in results],
        "chosen": asdict(chosen.setup) | {"metrics": chosen.metrics} if chosen else None,
        # What users get from the chosen variant: optimize's figure on the original files (serving framing).
        "chosen_served_accuracy": next(
            (v.served_accuracy for v in manifest.variants if chosen and v.name == chosen.setup.variant), None
        ),
        "variants": [
            {
                "name": v.name,
                "macs": variant_macs(v, manifest.variants),
                "parameters": v.parameters,
                "size_bytes": v.size_bytes,
                "served_accuracy": v.served_accuracy,
            }
            for v in manifest.variants
            if v.accepted
        ],
        "sgemm_gmacs": sgemm,  # by library; the faster is the roofline
        "headline": rounds,
    }


def _served_mark(setup: dict[str, Any], chosen: dict[str, Any]) -> str:
    fields = ("variant", "backend", "setting", "threads")
    return " **(served)**" if chosen and all(setup[k] == chosen[k] for k in fields) else ""


def _setup_row(r: dict[str, Any], results: Sequence[dict[str, Any]], chosen: dict[str, Any], batch: int) -> str:
    s = r["setup"]
    m = r.get("metrics", {})
    threads = "all" if s["threads"] == 0 else str(s["threads"])
    if r["status"] != "ok":
        return f"| {s['variant']} | {s['backend']} | {s['setting']} | {threads} | {r['status']}: {r.get('error')} | | | | | | | | |"
    speed = lat = None
    base = baseline_of(results, s["threads"])
    if base:
        speed = m[f"throughput_b{batch}"] / base["metrics"][f"throughput_b{batch}"]
        lat = base["metrics"]["p50_ms"] / m["p50_ms"]
    return (
        f"| {s['variant']}{_served_mark(s, chosen)} | {s['backend']} | {s['setting']} | {threads} | "
        f"{_fmt(m.get('p50_ms'), 3)} | {_fmt(m.get('p99_ms'), 3)} | {_fmt(m.get(f'throughput_b{batch}'), 0)} | "
        f"{_fmt(m.get('throughput_b256'), 0)} | {_fmt(speed, 2)}× | {_fmt(lat, 2)}× | {m.get('accuracy', 0):.4f} | "
        f"{_fmt(m.get('startup_s'), 2)} | {_fmt(m.get('peak_memory_mb'), 0)} |"
    )


def markdown_table(report: dict[str, Any], batch: int = 32) -> str:
    results = report["results"]
    chosen = report.get("chosen") or {}
    machine = report["machine"]
    lines = [
        f"Machine: {machine.get('cpu')} ({machine.get('architecture')}, {machine.get('cores')} cores, ISA "
        f"{' '.join(machine.get('isa', [])) or '–'}); torch {machine.get('torch')} (BLAS {machine.get('blas')}, "
        f"oneDNN {machine.get('onednn')}, ACL {machine.get('acl')}), onnxruntime {machine.get('onnxruntime')}",
        "",
        *headline_line(report),
        f"| variant | backend | setting | threads | p50 ms (b1) | p99 ms (b1) | img/s b{batch} | img/s b256 "
        f"| × baseline b{batch} | × baseline p50 | accuracy | start s | peak MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_setup_row(r, results, chosen, batch) for r in results]
    lines += per_variant_table(report, batch)
    return "\n".join(lines) + "\n"


def headline_line(report: dict[str, Any]) -> list[str]:
    """The interleaved rounds' ratio, above the table whose single measurements it summarises."""
    rounds = report.get("headline")
    if not rounds:
        return []
    return [
        f"**{rounds['served']} against PyTorch's default eager ({rounds['baseline']}), batch {rounds['batch']}: "
        f"{rounds['median']:.2f}× the median of {rounds['rounds']} rounds timed alternately "
        f"(range {rounds['low']:.2f}–{rounds['high']:.2f}×; {rounds['served_img_s_median']:,.0f} against "
        f"{rounds['baseline_img_s_median']:,.0f} img/s).** The table below is one measurement of each setup.",
        "",
    ]


def variant_macs(variant: Any, variants: Sequence[Any]) -> int | None:
    """Multiply-adds per image that optimize recorded for the variant, else for the variant it was made from (a
    bf16 copy or an exported graph does the same work as its source)."""
    by_name = {v.name: v for v in variants}
    seen: set[str] = set()
    while variant is not None and variant.name not in seen:
        if variant.details.get("macs"):
            return int(variant.details["macs"])
        seen.add(variant.name)
        variant = by_name.get(variant.source)
    return None


def per_variant_table(report: dict[str, Any], batch: int = 32) -> list[str]:
    """One row per accepted variant: its work (multiply-adds, parameters, size), its served accuracy (optimize's,
    on the original files) and its fastest all-core setup here, as a rate against PyTorch's default eager and as
    multiply-adds per second against the fp32 sgemm roofline row (int8 kernels can pass it: VNNI / AMX / i8mm)."""
    variants = report.get("variants") or []
    if not variants:
        return []
    key = f"throughput_b{batch}"
    ok = [r for r in report["results"] if r["status"] == "ok" and r["setup"]["threads"] == 0 and key in r["metrics"]]
    default = benchmark_report.default_eager(report["results"], batch)
    by_library = report.get("sgemm_gmacs") or {}
    roofline = max(by_library, key=by_library.__getitem__, default=None)
    sgemm = by_library[roofline] if roofline else None
    lines = [
        "",
        f"Per variant: its fastest setup on all cores (batch {batch}); GMAC/s = multiply-adds per image × images/s; "
        f"the roofline row is fp32 sgemm ({SGEMM_SIDE}², all cores), the faster of "
        + (", ".join(f"{k} {v:,.1f}" for k, v in by_library.items()) or "no library measured")
        + " GMAC/s. About 100 %: at the cores' fp32 rate (a large matrix multiply is a close bound, not an exact "
        "one); well above: narrower arithmetic the CPU accelerates (int8 dot products: VNNI, AMX, i8mm).",
        "",
        f"| variant | multiply-adds / image | parameters | size | served accuracy | fastest setup | p50 ms (b1) "
        f"| img/s b{batch} | img/s b256 | × default eager b{batch} | GMAC/s b{batch} | of sgemm |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for v in variants:
        best = max((r for r in ok if r["setup"]["variant"] == v["name"]), key=lambda r: r["metrics"][key], default=None)
        lines.append(_variant_row(v, best, default, sgemm, key))
    lines.append(
        f"| roofline: fp32 sgemm | – | – | – | – | {roofline or '–'} / all cores | – | – | – | – | {_fmt(sgemm, 1)} | "
        f"{'100 %' if sgemm else '–'} |"
    )
    return lines


def _variant_row(
    v: dict[str, Any], best: dict[str, Any] | None, default: dict[str, Any] | None, sgemm: float | None, key: str
) -> str:
    macs = v.get("macs")
    work = f"{macs / 1e6:.1f} M" if macs else "–"
    head = (
        f"| {v['name']} | {work} | {v['parameters']:,} | {v['size_bytes'] / 1024:,.1f} KiB | "
        f"{_fmt(v.get('served_accuracy'), 4)} |"
    )
    if best is None:
        return f"{head} not timed | | | | | | |"
    m, s = best["metrics"], best["setup"]
    speed = m[key] / default["metrics"][key] if default else None
    gmacs = macs * m[key] / 1e9 if macs else None
    share = f"{100 * gmacs / sgemm:.0f} %" if gmacs and sgemm else "–"
    return (
        f"{head} {s['backend']} / {s['setting']} | {_fmt(m.get('p50_ms'), 3)} | {_fmt(m[key], 0)} | "
        f"{_fmt(m.get('throughput_b256'), 0)} | {_fmt(speed, 2)}× | {_fmt(gmacs, 1)} | {share} |"
    )


def _plot(report: dict[str, Any], path: Path, batch: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in report["results"] if r["status"] == "ok" and r["setup"]["threads"] == 0]
    labels = [f"{r['setup']['variant']}\n{r['setup']['backend']}\n{r['setup']['setting']}" for r in ok]
    values = [r["metrics"][f"throughput_b{batch}"] for r in ok]
    fig, ax = plt.subplots(figsize=(max(6, len(ok) * 1.2), 4.5))
    ax.bar(range(len(ok)), values, color="#4477aa")
    ax.set_xticks(range(len(ok)), labels, fontsize=7)
    ax.set_ylabel(f"images/s at batch {batch} (all cores)")
    ax.set_title(f"{report['machine'].get('cpu')} ({report['machine'].get('architecture')})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(report: dict[str, Any], config: BenchmarkConfig) -> None:
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    batch = config.batch_sizes[0]
    benchmark_report.write(report, REPORT_DIR / "report.json")
    (REPORT_DIR / "table.md").write_text(markdown_table(report, batch))
    rows = ["setup,variant,backend,setting,threads,p50_ms,throughput,accuracy"]
    for r in report["results"]:
        if r["status"] == "ok":
            s, m = r["setup"], r["metrics"]
            label = f"{s['variant']}/{s['backend']}/{s['setting']}/{s['threads'] or 'all'}"
            rows.append(f"{label},{s['variant']},{s['backend']},{s['setting']},{s['threads']},"
                        f"{m['p50_ms']:.4f},{m[f'throughput_b{batch}']:.1f},{m['accuracy']:.4f}")  # fmt: skip
    (REPORT_DIR / "results.csv").write_text("\n".join(rows) + "\n")
    (REPORT_DIR / "metrics.json").write_text(json.dumps(headline(report, batch), indent=2) + "\n")
    _plot(report, REPORT_DIR / "throughput.png", batch)


def served_figures(report: dict[str, Any], batch: int) -> dict[str, Any]:
    """The served setup's figures at batch `batch`, unrounded (empty without a choice): its throughput (None where
    that batch was not timed), latencies and accuracies; its speed-up on PyTorch's default eager (the median of the
    interleaved rounds, with their low, high and count, where they ran at this batch; else the single measurements,
    the eager one at its better thread count); on the oneDNN-off eager; its p50 gain on the fp32 eager baseline.
    headline() (metrics.json) and served_headline() (MLflow) both show these."""
    chosen = report.get("chosen")
    if not chosen:
        return {}
    m, key, results = chosen["metrics"], f"throughput_b{batch}", report["results"]
    out: dict[str, Any] = {
        "served": f"{chosen['variant']} / {chosen['backend']}",
        "throughput": m.get(key),
        "p50_ms": m["p50_ms"],
        "p99_ms": m.get("p99_ms"),
        # The timed inputs are the prepared ROI crops: that is the accuracy measured here; what users get on
        # original files is optimize's served figure of the chosen variant.
        "roi_accuracy": m["accuracy"],
        "served_accuracy": report.get("chosen_served_accuracy"),
    }
    # Against what users would otherwise run, each at its better thread count (1 or all).
    default = benchmark_report.default_eager(results, batch)
    if default and key in m:
        out["speedup"] = m[key] / default["metrics"][key]
        out["default_threads"] = "all" if default["setup"]["threads"] == 0 else str(default["setup"]["threads"])
    rounds = report.get("headline")
    if rounds and rounds["batch"] == batch:  # the headline: the median of the interleaved rounds, and its range
        out |= {"speedup": rounds["median"], "low": rounds["low"], "high": rounds["high"], "rounds": rounds["rounds"]}
    off = benchmark_report.best_eager(results, ONEDNN_OFF_EAGER, batch)
    if off and key in m:
        out["speedup_vs_onednn_off"] = m[key] / off["metrics"][key]
    base = baseline_of(results, 0)
    if base:
        out["p50_gain"] = base["metrics"]["p50_ms"] / m["p50_ms"]
    return out


def headline(report: dict[str, Any], batch: int) -> dict[str, float | str]:
    """The served setup against PyTorch's default eager and the oneDNN-off eager (each at its better thread count),
    with the CPU's ISA, rounded: DVC metrics (reports/benchmark/metrics.json)."""
    figures = served_figures(report, batch)
    if not figures:
        return {"served": "none"}
    out: dict[str, float | str] = {"served": figures["served"]}
    if figures["throughput"] is not None:
        out[f"served_throughput_b{batch}"] = round(figures["throughput"], 1)
    out["served_p50_ms"] = round(figures["p50_ms"], 4)
    out["served_roi_accuracy"] = round(figures["roi_accuracy"], 4)
    if figures["served_accuracy"] is not None:
        out["served_accuracy"] = round(float(figures["served_accuracy"]), 4)
    if "speedup" in figures:
        out[f"speedup_b{batch}_vs_default_eager"] = round(figures["speedup"], 2)
    if "default_threads" in figures:
        out["default_eager_threads"] = figures["default_threads"]
    if "rounds" in figures:
        out[f"speedup_b{batch}_vs_default_eager_range"] = f"{figures['low']:.2f}-{figures['high']:.2f}"
        out["headline_rounds"] = figures["rounds"]
    if "speedup_vs_onednn_off" in figures:
        out[f"speedup_b{batch}_vs_eager_onednn_off"] = round(figures["speedup_vs_onednn_off"], 2)
    if "p50_gain" in figures:
        out["p50_gain_vs_fp32_eager"] = round(figures["p50_gain"], 2)
    out["isa"] = " ".join(report["machine"].get("isa", [])) or "unknown"
    return out


def served_headline(report: dict[str, Any], manifest: Any, chosen: Result) -> dict[str, float]:
    """The served setup's figures for the pipeline's parent run (tracking.HEADLINE_METRICS, whose names are at batch
    32: a run that timed no batch of 32 has no throughput or speed-up there), unrounded."""
    figures = served_figures(report, 32)
    named = {
        "served_throughput_b32": figures["throughput"],
        "served_p50_ms": figures["p50_ms"],
        "served_p99_ms": figures["p99_ms"],
        "served_size_bytes": next(v.size_bytes for v in manifest.variants if v.name == chosen.setup.variant),
        "served_accuracy": figures["served_accuracy"],
        # PyTorch's default eager (oneDNN on, the better of 1 and all threads): what users would otherwise run
        "speedup_b32_vs_default_eager": figures.get("speedup"),
        "speedup_b32_vs_default_eager_low": figures.get("low"),
        "speedup_b32_vs_default_eager_high": figures.get("high"),
    }
    return {name: float(value) for name, value in named.items() if value is not None}


def compare(paths: Sequence[Path], batch: int = 32) -> str:
    """One table for several machines' reports, each row with ratios against its own machine's baseline."""
    lines = [
        f"| machine | variant | backend | setting | img/s b{batch} | × baseline | p50 ms | × baseline p50 | accuracy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for path in paths:
        report = benchmark_report.read(Path(path))
        results = report.results
        base = baseline_of(results)
        m = report.machine
        machine = f"{m.get('architecture')} {m.get('cpu')}"
        for r in results:
            if r["status"] != "ok" or r["setup"]["threads"] != 0:
                continue
            s, x = r["setup"], r["metrics"]
            speed = x[f"throughput_b{batch}"] / base["metrics"][f"throughput_b{batch}"] if base else None
            lat = base["metrics"]["p50_ms"] / x["p50_ms"] if base else None
            lines.append(f"| {machine} | {s['variant']} | {s['backend']} | {s['setting']} | "
                         f"{x[f'throughput_b{batch}']:,.0f} | {_fmt(speed, 2)}× | {x['p50_ms']:.3f} | "
                         f"{_fmt(lat, 2)}× | {x['accuracy']:.4f} |")  # fmt: skip
    return "\n".join(lines) + "\n"
