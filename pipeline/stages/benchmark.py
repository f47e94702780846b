"""The benchmark stage: every accepted variant on every backend this machine has, each measured in its
own subprocess (so oneDNN, thread and fast-math switches apply before import), side by side in one run.

    models/manifest.json --> one worker process per (variant, backend, setting, threads)
        --> reports/benchmark/report.json (machine facts + every result, failures included)
        --> reports/benchmark/table.md (GitHub job summary), results.csv (DVC plots), throughput.png
        --> reports/benchmark/profile.txt (where the chosen variant spends its time)
        --> models/serving.json: the fastest variant x runtime for the server that passed the accuracy gate
            (evaluate's quality gate then decides whether it becomes the registry's `champion`)

`pipeline compare REPORT...` merges reports of several machines (x86 and Arm runners) into one table.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from pipeline.artifacts import MODELS_DIR, REPORTS_DIR, benchmark_report
from pipeline.artifacts import serving as serving_file
from pipeline.artifacts.prepared import MANIFEST_FILE, PREPARED_DIR, ModelInput, read_split
from pipeline.config import BenchmarkConfig, Params
from pipeline.console import Steps, log
from pipeline.errors import StageError

REPORT_DIR = REPORTS_DIR / "benchmark"
UNSERVED_AGREEMENT_IMAGES = 128  # test images a setup the server cannot run is scored and compared on
BASELINE = ("fp32", "torch-eager", "onednn-off")  # the learning path's "OpenBLAS" setup: ATen + the build's BLAS


@dataclass(frozen=True)
class Setup:
    variant: str
    backend: str
    setting: str  # "default", "onednn-off", "onednn-on", "bf16-fpmath"
    threads: int  # 0 = all cores

    @property
    def label(self) -> str:
        threads = "all cores" if self.threads == 0 else f"{self.threads} thread"
        return f"{self.variant} / {self.backend} / {self.setting} / {threads}"


@dataclass
class Result:
    setup: Setup
    status: str  # ok | failed | skipped
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    predicted: list[int] | None = None
    """Top-1 class of every test image (the choice's label-free guard; not written to the report)."""

    def record(self) -> dict[str, Any]:
        """What report.json keeps of it."""
        return {k: v for k, v in asdict(self).items() if k != "predicted"}


def bf16_capable(isa: Sequence[str], architecture: str | None = None) -> bool:
    from pipeline.machine import has_native_bf16

    return has_native_bf16(set(isa), architecture)


def plan(manifest: Any, facts: dict[str, Any], config: BenchmarkConfig) -> tuple[list[Setup], list[Result]]:
    """Which setups to run on this machine, and which are skipped (with the reason)."""
    setups: list[Setup] = []
    skipped: list[Result] = []
    thread_counts = sorted(set(config.threads))
    for variant in manifest.variants:
        if not variant.accepted:
            continue
        for backend in variant.runtimes:
            if config.backends and backend not in config.backends:
                continue
            if backend == "torch-eager" and getattr(variant, "format", "") == "torch-export":
                reason = "pt2e int8 graphs run reference kernels in eager mode: timed compiled only"
                skipped.append(Result(Setup(variant.name, backend, "default", 0), "skipped", reason))
                continue
            if "cuda" in backend and not facts.get("cuda"):
                skipped.append(Result(Setup(variant.name, backend, "default", 0), "skipped", "no CUDA device"))
                continue
            settings = ["default"]
            if backend == "torch-eager" and facts.get("onednn_available"):
                settings = ["onednn-off", "onednn-on"]
                if bf16_capable(facts.get("isa", []), facts.get("architecture")):
                    settings.append("bf16-fpmath")
                else:
                    skipped.append(
                        Result(Setup(variant.name, backend, "bf16-fpmath", 0), "skipped", "CPU has no native bf16")
                    )
            for setting in settings:
                for threads in thread_counts:
                    setups.append(Setup(variant.name, backend, setting, threads))
    return setups, skipped


def _worker_env(setup: Setup) -> dict[str, str]:
    env = dict(os.environ)
    if setup.threads:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[var] = str(setup.threads)
    if setup.setting == "bf16-fpmath":
        env["DNNL_DEFAULT_FPMATH_MODE"] = "BF16"
    return env


def run_setup(setup: Setup, config: BenchmarkConfig, timeout_s: float, throughput_only: bool = False) -> Result:
    """Measure one setup in a fresh interpreter; a crash, hang or error becomes a failed result."""
    command = [sys.executable, "-m", "pipeline.stages.benchmark", json.dumps(asdict(setup)), config.model_dump_json()]
    command += ["--throughput-only"] if throughput_only else []
    try:
        done = subprocess.run(
            command, env=_worker_env(setup), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return Result(setup, "failed", f"timed out after {timeout_s:.0f} s")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return Result(setup, "failed", f"exit {done.returncode}: {tail[:300]}")
    measured = json.loads(lines[-1])
    return Result(setup, "ok", metrics=measured, predicted=measured.pop("predicted", None))


SGEMM_SIDE = 2048


def measure_sgemm(seconds: float = 1.0) -> dict[str, float]:
    """The machine's fp32 multiply-add rate (GMAC/s) on a large matrix multiply, all cores, by each library the
    runtimes use (torch.mm: the build's BLAS; ONNX Runtime's MatMul: MLAS). The faster is the roofline of the
    per-variant table: one library alone can understate what the cores do (docs/stages.md, benchmark). Measured in
    the stage's own process, after the setups: it has torch loaded for the machine facts and sets no switch a setup
    sets (threads, oneDNN, fast-math), so a fresh interpreter would measure the same and cost its start-up. Empty
    when it cannot be measured. `seconds` per library: benchmark.min_seconds, as for the setups."""
    try:
        return _sgemm_rates(seconds)
    except Exception as exc:  # a roofline is context, never a reason to fail the stage
        log(f"benchmark: roofline not measured ({type(exc).__name__}: {str(exc)[:200]})")
        return {}


def _best_rate(call: Any, seconds: float = 1.0, rounds: int = 3) -> float:
    """Calls per second of `call`, the best of `rounds` short runs (the machine is shared)."""
    call()
    best = 0.0
    for _ in range(rounds):
        calls, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds / rounds or calls == 0:
            call()
            calls += 1
        best = max(best, calls / elapsed)
    return best


def _sgemm_rates(seconds: float) -> dict[str, float]:
    import torch

    n = SGEMM_SIDE
    a, b = torch.rand(n, n), torch.rand(n, n)
    rates = {"torch.mm": _best_rate(lambda: torch.mm(a, b), seconds) * n**3 / 1e9}
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper
    except ImportError:
        return rates
    tensor = partial(helper.make_tensor_value_info, elem_type=TensorProto.FLOAT, shape=[n, n])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["c"])], "sgemm", [tensor("a"), tensor("b")], [tensor("c")]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = {"a": a.numpy(), "b": b.numpy()}  # torch.rand is float32 already
    rates["onnxruntime MatMul"] = _best_rate(lambda: session.run(None, feed), seconds) * n**3 / 1e9
    return rates


# ---- the worker: runs in its own process -----------------------------------------------------------------


def _percentiles(seconds: list[float]) -> dict[str, float]:
    import numpy as np

    ms = np.array(seconds) * 1000.0
    return {f"p{q}_ms": float(np.percentile(ms, q)) for q in (50, 90, 99)}


def _throughput(predict: Any, batch: Any, min_seconds: float, min_calls: int) -> float:
    predict(batch)  # warm-up at this shape
    calls = 0
    started = time.perf_counter()
    while calls < min_calls or time.perf_counter() - started < min_seconds:
        predict(batch)
        calls += 1
    return calls * len(batch) / (time.perf_counter() - started)


def measure(setup: Setup, config: BenchmarkConfig, throughput_only: bool = False) -> dict[str, float]:
    import numpy as np

    if setup.backend.startswith("torch"):
        import torch

        if setup.threads:
            torch.set_num_threads(setup.threads)
        if setup.setting == "onednn-off":
            torch.backends.mkldnn.enabled = False  # type: ignore[assignment]
    from pipeline.runtimes import open_runtime

    test = ModelInput.of_split("test")
    # The timing loops cycle through a sample in memory; the accuracy below reads the split a batch at a time.
    images, labels = test.head(max(256, *config.batch_sizes)), test.labels

    started = time.perf_counter()
    runtime = open_runtime(MODELS_DIR, setup.variant, backend=setup.backend, threads=setup.threads or None)
    runtime.predict(images[:1])
    startup_s = time.perf_counter() - started

    if throughput_only:  # a headline round: the first batch size only
        size = config.batch_sizes[0]
        batch = np.resize(images, (size, *images.shape[1:])) if size > len(images) else images[:size]
        return {f"throughput_b{size}": _throughput(runtime.predict, batch, config.min_seconds, 3)}
    for i in range(config.warmup):
        runtime.predict(images[i % len(images)][None])
    latencies = []
    deadline = time.perf_counter() + config.min_seconds
    i = 0
    while i < config.latency_calls or time.perf_counter() < deadline:
        one = images[i % len(images)][None]
        t = time.perf_counter()
        runtime.predict(one)
        latencies.append(time.perf_counter() - t)
        i += 1
        if i >= 20 * config.latency_calls:
            break
    metrics: dict[str, float] = {"startup_s": startup_s, **_percentiles(latencies)}
    for size in config.batch_sizes:
        batch = np.resize(images, (size, *images.shape[1:])) if size > len(images) else images[:size]
        metrics[f"throughput_b{size}"] = _throughput(runtime.predict, batch, config.min_seconds, 3)

    chunk = config.batch_sizes[0]  # the timed batch size: a fixed 256 held gigabytes at 224 px
    if setup.backend in config.serving_backends:
        predicted = np.concatenate([runtime.predict(batch).argmax(axis=1) for batch in test.batches(chunk)])
    else:  # what the server cannot run is compared on a sample: a slow eager setup took minutes on a whole split
        sample = test.head(UNSERVED_AGREEMENT_IMAGES)
        predicted = np.concatenate(
            [runtime.predict(sample[i : i + chunk]).argmax(axis=1) for i in range(0, len(sample), chunk)]
        )
    metrics["accuracy"] = float(
        (predicted == labels[: len(predicted)]).mean()
    )  # reported; the choice reads `predicted`
    from pipeline.machine import own_peak_rss_mib

    metrics["peak_memory_mb"] = own_peak_rss_mib()
    return {**metrics, "predicted": predicted.tolist()}


# ---- reports, choice, profile ---------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def baseline_of(results: Sequence[dict[str, Any]], threads: int = 0) -> dict[str, Any] | None:
    """The fp32 eager oneDNN-off result at the same thread count (else the first eager one there)."""
    ok = [r for r in results if r["status"] == "ok" and r["setup"]["threads"] == threads]
    for r in ok:
        s = r["setup"]
        if (s["variant"], s["backend"], s["setting"]) == BASELINE:
            return r
    return next((r for r in ok if r["setup"]["backend"] == "torch-eager"), None)


def markdown_table(report: dict[str, Any], batch: int = 32) -> str:
    results = report["results"]
    chosen = report.get("chosen") or {}
    lines = [
        f"Machine: {report['machine'].get('cpu')} ({report['machine'].get('architecture')}, "
        f"{report['machine'].get('cores')} cores, ISA {' '.join(report['machine'].get('isa', [])) or '–'}); "
        f"torch {report['machine'].get('torch')} (BLAS {report['machine'].get('blas')}, oneDNN "
        f"{report['machine'].get('onednn')}, ACL {report['machine'].get('acl')}), onnxruntime "
        f"{report['machine'].get('onnxruntime')}",
        "",
        *headline_line(report),
        f"| variant | backend | setting | threads | p50 ms (b1) | p99 ms (b1) | img/s b{batch} | img/s b256 "
        f"| × baseline b{batch} | × baseline p50 | accuracy | start s | peak MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = r["setup"]
        m = r.get("metrics", {})
        mark = " **(served)**" if chosen and (s["variant"], s["backend"], s["setting"], s["threads"]) == (
            chosen["variant"], chosen["backend"], chosen["setting"], chosen["threads"]
        ) else ""  # fmt: skip
        threads = "all" if s["threads"] == 0 else str(s["threads"])
        if r["status"] != "ok":
            lines.append(f"| {s['variant']} | {s['backend']} | {s['setting']} | {threads} | {r['status']}: "
                         f"{r.get('error')} | | | | | | | | |")  # fmt: skip
            continue
        speed = lat = None
        base = baseline_of(results, s["threads"])
        if base:
            speed = m[f"throughput_b{batch}"] / base["metrics"][f"throughput_b{batch}"]
            lat = base["metrics"]["p50_ms"] / m["p50_ms"]
        lines.append(
            f"| {s['variant']}{mark} | {s['backend']} | {s['setting']} | {threads} | {_fmt(m.get('p50_ms'), 3)} | "
            f"{_fmt(m.get('p99_ms'), 3)} | {_fmt(m.get(f'throughput_b{batch}'), 0)} | {_fmt(m.get('throughput_b256'), 0)} | "
            f"{_fmt(speed, 2)}× | {_fmt(lat, 2)}× | {m.get('accuracy', 0):.4f} | {_fmt(m.get('startup_s'), 2)} | "
            f"{_fmt(m.get('peak_memory_mb'), 0)} |"
        )
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
        runs = [r for r in ok if r["setup"]["variant"] == v["name"]]
        best = max(runs, key=lambda r: r["metrics"][key], default=None)
        macs = v.get("macs")
        work = f"{macs / 1e6:.1f} M" if macs else "–"
        head = (
            f"| {v['name']} | {work} | {v['parameters']:,} | {v['size_bytes'] / 1024:,.1f} KiB | "
            f"{_fmt(v.get('served_accuracy'), 4)} |"
        )
        if best is None:
            lines.append(f"{head} not timed | | | | | | |")
            continue
        m, s = best["metrics"], best["setup"]
        speed = m[key] / default["metrics"][key] if default else None
        gmacs = macs * m[key] / 1e9 if macs else None
        share = f"{100 * gmacs / sgemm:.0f} %" if gmacs and sgemm else "–"
        lines.append(
            f"{head} {s['backend']} / {s['setting']} | {_fmt(m.get('p50_ms'), 3)} | {_fmt(m[key], 0)} | "
            f"{_fmt(m.get('throughput_b256'), 0)} | {_fmt(speed, 2)}× | {_fmt(gmacs, 1)} | {share} |"
        )
    lines.append(
        f"| roofline: fp32 sgemm | – | – | – | – | {roofline or '–'} / all cores | – | – | – | – | {_fmt(sgemm, 1)} | "
        f"{'100 %' if sgemm else '–'} |"
    )
    return lines


def choose(results: Sequence[Result], config: BenchmarkConfig) -> Result | None:
    """Fastest setup at batch 32 (all cores) among the server's runtimes whose answers agree with its variant's
    reference run (the variant on its first runtime, default settings, all cores) on at least 1 - max_accuracy_drop
    of the test images: a backend must not change what its variant predicts. Label-free: optimize gated the variants
    themselves (on validation, or on agreement with the trained model), and no choice here reads the test labels."""
    references = reference_predictions(results)

    def agrees(r: Result) -> bool:
        reference = references.get(r.setup.variant)
        if r.predicted is None or reference is None:
            return False
        n = min(len(reference), len(r.predicted))  # a reference the server cannot run scored the first images only
        same = sum(a == b for a, b in zip(r.predicted[:n], reference[:n], strict=True))
        return n > 0 and same >= (1 - config.max_accuracy_drop) * n - 1e-9

    candidates = [
        r for r in results
        if r.status == "ok" and r.setup.threads == 0 and r.setup.backend in config.serving_backends and agrees(r)
    ]  # fmt: skip
    key = f"throughput_b{config.batch_sizes[0]}"
    return max(candidates, key=lambda r: r.metrics[key], default=None)


def reference_predictions(results: Sequence[Result]) -> dict[str, list[int]]:
    """Each variant's answers on its first measured setup at default settings and all cores (plan() measures a
    variant's own runtime first)."""
    references: dict[str, list[int]] = {}
    for r in results:
        default = r.setup.setting in ("default", "onednn-on") and r.setup.threads == 0
        if r.status == "ok" and default and r.predicted is not None and r.setup.variant not in references:
            references[r.setup.variant] = r.predicted
    return references


def no_servable_setup(variants: Sequence[Any], config: BenchmarkConfig) -> str:
    """Why nothing can be served: no shipped variant runs on the server's backends (each rejected one with
    optimize's reason), or some did but every setup of them lost accuracy here."""
    backends = ", ".join(config.serving_backends)
    runnable = [v for v in variants if set(v.runtimes) & set(config.serving_backends)]
    if not any(v.accepted for v in runnable):
        rejected = "; ".join(f"{v.name}: {v.reason}" for v in runnable if not v.accepted) or "none was made"
        others = sorted({v.name for v in variants if v.accepted} - {v.name for v in runnable})
        return (
            f"optimize shipped no variant that runs on {backends} (benchmark.serving_backends): {rejected}. "
            + (f"Shipped, on other backends: {', '.join(others)}; " if others else "")
            + "see reports/optimize/variants.md; relax the optimize gates, or serve another backend"
        )
    return (
        f"no setup among {backends} passed the accuracy gate (each within {config.max_accuracy_drop} of its "
        f"variant's accuracy in models/manifest.json); see {REPORT_DIR / 'table.md'}"
    )


def profile(setup: Setup, manifest: Any, out: Path) -> None:
    """Operator-level profile of the chosen setup: ONNX Runtime's profiler or torch.profiler."""

    batch = read_split("test", head=32).model_input()
    variant = next(v for v in manifest.variants if v.name == setup.variant)
    if setup.backend == "onnxruntime":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = str(out.parent / "ort_profile")
        session = ort.InferenceSession(str(MODELS_DIR / variant.file), options, providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        for _ in range(20):
            session.run(None, {name: batch})
        trace = Path(session.end_profiling())
        totals: dict[str, list[float]] = {}
        for event in json.loads(trace.read_text()):
            if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
                op = event.get("args", {}).get("op_name", "?")
                totals.setdefault(op, []).append(event["dur"])
        trace.unlink()
        grand = sum(sum(v) for v in totals.values()) or 1.0
        rows = sorted(totals.items(), key=lambda kv: -sum(kv[1]))
        text = [
            f"ONNX Runtime profile: {setup.label}, 20 batches of 32",
            "",
            f"{'op':24} {'calls':>6} {'total ms':>10} {'%':>6}",
        ]
        text += [f"{op:24} {len(d):6d} {sum(d) / 1000:10.2f} {100 * sum(d) / grand:6.1f}" for op, d in rows]
        out.write_text("\n".join(text) + "\n")
        return
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


def headline(report: dict[str, Any], batch: int) -> dict[str, float | str]:
    """The served setup against PyTorch's default eager and the oneDNN-off eager (each at its better thread count),
    with the CPU's ISA: DVC metrics and MLflow."""
    chosen = report.get("chosen")
    base = baseline_of(report["results"], 0)
    if not chosen:
        return {"served": "none"}
    m = chosen["metrics"]
    out: dict[str, float | str] = {
        "served": f"{chosen['variant']} / {chosen['backend']}",
        f"served_throughput_b{batch}": round(m[f"throughput_b{batch}"], 1),
        "served_p50_ms": round(m["p50_ms"], 4),
        # The timed inputs are the prepared ROI crops: that is the accuracy measured here; what users get on
        # original files is optimize's served figure of the chosen variant.
        "served_roi_accuracy": round(m["accuracy"], 4),
    }
    if report.get("chosen_served_accuracy") is not None:
        out["served_accuracy"] = round(float(report["chosen_served_accuracy"]), 4)
    # Against what users would otherwise run, each at its better thread count (1 or all).
    default = benchmark_report.default_eager(report["results"], batch)
    if default:
        out[f"speedup_b{batch}_vs_default_eager"] = round(
            m[f"throughput_b{batch}"] / default["metrics"][f"throughput_b{batch}"], 2
        )
        out["default_eager_threads"] = "all" if default["setup"]["threads"] == 0 else str(default["setup"]["threads"])
    rounds = report.get("headline")
    if rounds and rounds["batch"] == batch:  # the headline: the median of the interleaved rounds, and its range
        out[f"speedup_b{batch}_vs_default_eager"] = round(rounds["median"], 2)
        out[f"speedup_b{batch}_vs_default_eager_range"] = f"{rounds['low']:.2f}-{rounds['high']:.2f}"
        out["headline_rounds"] = rounds["rounds"]
    off = benchmark_report.best_eager(report["results"], benchmark_report.ONEDNN_OFF_EAGER, batch)
    if off:
        out[f"speedup_b{batch}_vs_eager_onednn_off"] = round(
            m[f"throughput_b{batch}"] / off["metrics"][f"throughput_b{batch}"], 2
        )
    if base:
        out["p50_gain_vs_fp32_eager"] = round(base["metrics"]["p50_ms"] / m["p50_ms"], 2)
    out["isa"] = " ".join(report["machine"].get("isa", [])) or "unknown"
    return out


def run(params: Params) -> None:
    from pipeline.machine import facts
    from pipeline.runtimes import read_manifest
    from pipeline.tracking import stage_run

    config = params.benchmark
    manifest = read_manifest(MODELS_DIR)
    if not (PREPARED_DIR / MANIFEST_FILE).is_file():
        raise StageError(f"{PREPARED_DIR / MANIFEST_FILE} is missing: run the prepare stage first")
    machine = facts()
    setups, results = plan(manifest, machine, config)
    if not setups:
        raise StageError("no variant/backend combination to benchmark (check benchmark.backends)")
    with stage_run("benchmark", params, {"benchmark": config.model_dump(mode="json")}) as tracker:
        began = time.perf_counter()
        steps = Steps("benchmark", len(setups))
        for setup in setups:
            with steps.running(setup.label):
                result = run_setup(setup, config, config.timeout_s)
            results.append(result)
            summary = (
                f"{result.metrics['throughput_b' + str(config.batch_sizes[0])]:,.0f} img/s, "
                f"p50 {result.metrics['p50_ms']:.3f} ms, acc {result.metrics['accuracy']:.4f}"
                if result.status == "ok" else f"{result.status}: {result.error}"
            )  # fmt: skip
            steps.finished(setup.label, summary)
        chosen = choose(results, config)
        rounds = headline_rounds(chosen, results, config)
        sgemm = measure_sgemm(config.min_seconds)
        log(f"benchmark: roofline, fp32 sgemm on all cores (GMAC/s): {json.dumps(sgemm) if sgemm else 'not measured'}")
        report: dict[str, Any] = {
            "machine": machine,
            "config": config.model_dump(mode="json"),
            "wall_s": time.perf_counter() - began,
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
        write_reports(report, config)
        if chosen is None:
            raise StageError(no_servable_setup(manifest.variants, config))
        measured = next(v.sha256 for v in manifest.variants if v.name == chosen.setup.variant)
        serving_file.write(serving_file.ServingChoice(**asdict(chosen.setup), metrics=chosen.metrics, sha256=measured))
        if config.profile:
            profile(chosen.setup, manifest, REPORT_DIR / "profile.txt")
        else:  # still written: dvc.yaml declares it, and a stale profile must not pass for this run's
            (REPORT_DIR / "profile.txt").write_text("profiling disabled (benchmark.profile: false)\n")
        for r in results:
            if r.status == "ok":
                key = f"{r.setup.variant}.{r.setup.backend}.{r.setup.setting}.t{r.setup.threads}"
                tracker.log_metrics({f"{key}.{k}": v for k, v in r.metrics.items()})
        for name in ("report.json", "table.md", "throughput.png", "profile.txt"):
            tracker.log_artifact(REPORT_DIR / name)
        tracker.set_tags({"chosen": chosen.setup.label})
        tracker.log_headline(served_headline(report, manifest, chosen))
        log(f"benchmark: serving {chosen.setup.label}, if evaluate's quality gate passes it")


def headline_rounds(chosen: Result | None, results: Sequence[Result], config: BenchmarkConfig) -> dict[str, Any] | None:
    """The served setup and PyTorch's default eager timed alternately, `benchmark.headline_rounds` times, each run in
    a fresh process: the ratio of each round, their median and range (None without the two, or with 0 rounds)."""
    key = f"throughput_b{config.batch_sizes[0]}"
    default = benchmark_report.default_eager([r.record() for r in results], config.batch_sizes[0])
    if chosen is None or default is None or config.headline_rounds == 0:
        return None
    baseline = Setup(**default["setup"])
    served, eager = [], []
    steps = Steps("benchmark headline", config.headline_rounds)
    for i in range(config.headline_rounds):
        with steps.running(f"round {i + 1}: {chosen.setup.label} and {baseline.label}"):
            pair = [run_setup(s, config, config.timeout_s, throughput_only=True) for s in (chosen.setup, baseline)]
        if any(r.status != "ok" for r in pair):
            return None
        served.append(pair[0].metrics[key])
        eager.append(pair[1].metrics[key])
        steps.finished(f"round {i + 1}", f"{served[-1] / eager[-1]:.2f}x")
    ratios = sorted(s / e for s, e in zip(served, eager, strict=True))
    return {
        "served": chosen.setup.label,
        "baseline": baseline.label,
        "batch": config.batch_sizes[0],
        "rounds": len(ratios),
        "ratios": [s / e for s, e in zip(served, eager, strict=True)],
        "median": statistics.median(ratios),
        "low": ratios[0],
        "high": ratios[-1],
        "served_img_s_median": statistics.median(served),
        "baseline_img_s_median": statistics.median(eager),
    }


def served_headline(report: dict[str, Any], manifest: Any, chosen: Result) -> dict[str, float]:
    """The served setup's figures for the pipeline's parent run (tracking.HEADLINE_METRICS)."""
    m = chosen.metrics
    out = {
        "served_throughput_b32": m["throughput_b32"],
        "served_p50_ms": m["p50_ms"],
        "served_p99_ms": m["p99_ms"],
        "served_size_bytes": float(next(v.size_bytes for v in manifest.variants if v.name == chosen.setup.variant)),
    }
    if report.get("chosen_served_accuracy") is not None:
        out["served_accuracy"] = float(report["chosen_served_accuracy"])
    default = benchmark_report.default_eager(report["results"])
    if default:  # PyTorch's default eager (oneDNN on, the better of 1 and all threads): what users would otherwise run
        out["speedup_b32_vs_default_eager"] = m["throughput_b32"] / default["metrics"]["throughput_b32"]
    rounds = report.get("headline")
    if rounds and rounds["batch"] == 32:  # the median of the interleaved rounds, with its range
        out["speedup_b32_vs_default_eager"] = rounds["median"]
        out["speedup_b32_vs_default_eager_low"] = rounds["low"]
        out["speedup_b32_vs_default_eager_high"] = rounds["high"]
    return out


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


if __name__ == "__main__":  # worker entry: python -m pipeline.stages.benchmark SETUP_JSON CONFIG_JSON
    worker_setup = Setup(**json.loads(sys.argv[1]))
    worker_config = BenchmarkConfig.model_validate_json(sys.argv[2])
    print(json.dumps(measure(worker_setup, worker_config, "--throughput-only" in sys.argv[3:])), flush=True)
