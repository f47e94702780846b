import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.benchmarking import choice, worker
from pipeline.benchmarking import report as reports
from pipeline.benchmarking.setups import Result, Setup, bf16_capable, plan
from pipeline.config import BenchmarkConfig
from pipeline.errors import StageError


def _variant(name: str, runtimes: list[str], accepted: bool = True, accuracy: float = 0.99) -> SimpleNamespace:
    return SimpleNamespace(name=name, runtimes=runtimes, accepted=accepted, accuracy=accuracy)


def test_plan_covers_every_accepted_variant_backend_and_setting() -> None:
    manifest = SimpleNamespace(
        variants=[
            _variant("fp32", ["torch-eager", "torch-compile"]),
            _variant("fp32-onnx", ["onnxruntime"]),
            _variant("bad", ["onnxruntime"], accepted=False),
            SimpleNamespace(
                name="int8-pt2e", runtimes=["torch-compile", "torch-eager"], accepted=True, format="torch-export"
            ),
        ]
    )
    facts = {"onednn_available": True, "isa": ["avx2"], "cuda": None}
    setups, skipped = plan(manifest, facts, BenchmarkConfig(threads=[0, 1]))
    labels = {(s.variant, s.backend, s.setting, s.threads) for s in setups}
    assert ("fp32", "torch-eager", "onednn-off", 0) in labels and ("fp32", "torch-eager", "onednn-on", 1) in labels
    assert ("fp32", "torch-compile", "default", 0) in labels and ("fp32-onnx", "onnxruntime", "default", 1) in labels
    assert not any(s.variant == "bad" for s in setups)
    assert ("int8-pt2e", "torch-compile", "default", 0) in labels
    assert not any(s.variant == "int8-pt2e" and s.backend == "torch-eager" for s in setups)
    assert len(setups) == 10
    assert [r.setup.setting for r in skipped] == ["bf16-fpmath", "default"]
    assert "compiled only" in (skipped[1].error or "")

    with_bf16, _ = plan(manifest, facts | {"isa": ["avx512_bf16"]}, BenchmarkConfig(threads=[0]))
    assert ("fp32", "torch-eager", "bf16-fpmath", 0) in {
        (s.variant, s.backend, s.setting, s.threads) for s in with_bf16
    }


def _ok(
    variant: str, backend: str, throughput: float, accuracy: float, threads: int = 0, p50: float = 1.0,
    predicted: list[int] | None = None,
) -> Result:  # fmt: skip
    metrics = {"throughput_b32": throughput, "throughput_b256": throughput, "p50_ms": p50, "p99_ms": p50 * 2,
               "accuracy": accuracy, "startup_s": 0.1, "peak_memory_mb": 100.0}  # fmt: skip
    return Result(Setup(variant, backend, "default", threads), "ok", metrics=metrics, predicted=predicted or [0] * 200)


def test_choice_is_the_fastest_serving_setup_that_agrees_with_its_variants_reference() -> None:
    """Label-free: a serving setup must give its variant's answers (its first, default run) on 1 - max_accuracy_drop
    of the test images; the accuracy column is never read."""
    config = BenchmarkConfig(max_accuracy_drop=0.005, serving_backends=["onnxruntime"])
    answers = [i % 7 for i in range(200)]
    one_off = [*answers[:-1], (answers[-1] + 1) % 7]  # 1 of 200 differs: 0.5 %, within the gate
    three_off = [(a + 1) % 7 if i < 3 else a for i, a in enumerate(answers)]  # 1.5 %: outside
    results = [
        _ok("fp32", "torch-compile", 9000, 0.99, predicted=answers),  # fastest, but the server image has no torch
        _ok("int8-onnx", "torch-compile", 100, 0.99, predicted=answers),  # int8-onnx's reference run
        _ok("int8-onnx", "onnxruntime", 8000, 0.99, predicted=three_off),  # fast, but it changed the answers
        _ok("fp32-onnx", "onnxruntime", 3000, 0.5, predicted=answers),  # the accuracy column plays no part
        _ok("pruned-onnx", "onnxruntime", 5000, 0.986, predicted=one_off),  # its own reference: chosen
        _ok("pruned-onnx", "onnxruntime", 7000, 0.986, threads=1, predicted=one_off),  # single-thread rows never serve
        Result(Setup("x", "onnxruntime", "default", 0), "failed", "boom"),
    ]
    chosen = choice.choose(results, config)
    assert chosen is not None and (chosen.setup.variant, chosen.setup.threads) == ("pruned-onnx", 0)
    assert choice.choose(results[:3], config) is None
    results[1] = _ok("int8-onnx", "torch-compile", 100, 0.99, predicted=[*three_off[:-1], answers[-1] + 1])
    results[2] = _ok("int8-onnx", "onnxruntime", 8000, 0.99, predicted=three_off)  # 1 of 200 from its reference
    assert choice.choose(results, config).setup.variant == "int8-onnx"  # type: ignore[union-attr]
    assert "predicted" not in results[2].record()  # the report keeps the figures, not the answers


def test_failing_setup_is_reported_and_the_rest_still_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no models/ here: the worker fails inside its own process
    result = worker.run_setup(Setup("fp32-onnx", "onnxruntime", "default", 0), BenchmarkConfig(), 120)
    assert result.status == "failed" and "exit 1" in (result.error or "")
    hung = worker.run_setup(Setup("fp32-onnx", "onnxruntime", "default", 0), BenchmarkConfig(), 0.01)
    assert hung.status == "failed" and "timed out" in (hung.error or "")


def _report(path: Path, arch: str, base: float, fast: float) -> Path:
    results = [_ok("fp32", "torch-eager", base, 0.99, p50=2.0), _ok("int8-onnx", "onnxruntime", fast, 0.989, p50=0.5)]
    results[0] = Result(Setup("fp32", "torch-eager", "onednn-off", 0), "ok", metrics=results[0].metrics)
    report = {"machine": {"architecture": arch, "cpu": "test cpu"}, "results": [
        {"setup": vars(r.setup), "status": r.status, "error": r.error, "metrics": r.metrics} for r in results]}  # fmt: skip
    path.write_text(json.dumps(report))
    return path


def test_compare_merges_reports_with_ratios_against_each_baseline(tmp_path: Path) -> None:
    x86 = _report(tmp_path / "x86.json", "x86_64", 1000, 12000)
    arm = _report(tmp_path / "arm.json", "aarch64", 500, 2000)
    table = reports.compare([x86, arm])
    rows = [line for line in table.splitlines() if line.startswith("| x86_64") or line.startswith("| aarch64")]
    assert len(rows) == 4
    assert "| x86_64 test cpu | int8-onnx | onnxruntime | default | 12,000 | 12.00× | 0.500 | 4.00× |" in table
    assert "| aarch64 test cpu | int8-onnx | onnxruntime | default | 2,000 | 4.00× |" in table
    with pytest.raises(StageError, match="not a benchmark report"):
        reports.compare([tmp_path / "missing.json"])


def test_markdown_table_marks_the_served_setup(tmp_path: Path) -> None:
    report = json.loads(_report(tmp_path / "r.json", "x86_64", 1000, 12000).read_text())
    report["chosen"] = report["results"][1]["setup"]
    table = reports.markdown_table(report)
    assert "int8-onnx **(served)**" in table and "12.00×" in table and "4.00×" in table


def test_benchmark_stage_on_a_real_tiny_model(benchmarked_project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(benchmarked_project)
    report = json.loads(Path("reports/benchmark/report.json").read_text())
    machine = report["machine"]
    for key in ("architecture", "cpu", "cores", "isa", "torch", "blas", "onednn", "acl", "onnxruntime"):
        assert key in machine
    ok = [r for r in report["results"] if r["status"] == "ok"]
    assert {(r["setup"]["variant"], r["setup"]["backend"]) for r in ok} >= {
        ("fp32", "torch-eager"),
        ("fp32-onnx", "onnxruntime"),
    }
    for r in ok:
        assert set(r["metrics"]) == {"startup_s", "p50_ms", "p90_ms", "p99_ms", "throughput_b32", "throughput_b256",
                                     "accuracy", "peak_memory_mb"}  # fmt: skip
        assert r["metrics"]["p50_ms"] <= r["metrics"]["p99_ms"] and 0 <= r["metrics"]["accuracy"] <= 1
    onednn = {r["setup"]["setting"] for r in ok if r["setup"]["backend"] == "torch-eager"}
    # bf16-fpmath only on CPUs with native bf16 (AVX-512 BF16 / AMX, Arm bf16)
    assert {"onednn-off", "onednn-on"} <= onednn <= {"onednn-off", "onednn-on", "bf16-fpmath"}
    assert ("bf16-fpmath" in onednn) == bf16_capable(machine["isa"], machine["architecture"])
    choice = json.loads(Path("models/serving.json").read_text())
    assert choice["backend"] == "onnxruntime" and report["chosen"]["variant"] == choice["variant"]
    table = Path("reports/benchmark/table.md").read_text()
    assert "**(served)**" in table
    # The per-variant table: every accepted variant with its work, and the measured fp32 sgemm roofline.
    assert report["sgemm_gmacs"]["torch.mm"] > 0 and report["sgemm_gmacs"]["onnxruntime MatMul"] > 0
    roofline = max(report["sgemm_gmacs"], key=report["sgemm_gmacs"].get)
    assert f"| roofline: fp32 sgemm | – | – | – | – | {roofline} / all cores |" in table
    manifest = json.loads(Path("models/manifest.json").read_text())
    accepted = [v["name"] for v in manifest["variants"] if v["accepted"]]
    assert [v["name"] for v in report["variants"]] == accepted
    for v in report["variants"]:  # every variant's work is known: its own record or its source's
        assert f"| {v['name']} | {v['macs'] / 1e6:.1f} M | {v['parameters']:,} |" in table
    assert Path("reports/benchmark/throughput.png").stat().st_size > 0
    assert "Conv" in Path("reports/benchmark/profile.txt").read_text()
    # The headline: the served setup and PyTorch's default eager timed alternately, median and range of the ratios.
    rounds = report["headline"]
    assert (
        rounds["rounds"] == 2
        and len(rounds["ratios"]) == 2
        and rounds["baseline"].startswith("fp32 / torch-eager / onednn-on")
    )
    assert rounds["low"] <= rounds["median"] <= rounds["high"] and rounds["low"] == min(rounds["ratios"])
    assert f"{rounds['median']:.2f}× the median of 2 rounds timed alternately" in table
    metrics = json.loads(Path("reports/benchmark/metrics.json").read_text())
    assert metrics["speedup_b32_vs_default_eager"] == round(rounds["median"], 2) and metrics["headline_rounds"] == 2


def _timed(variant: str, backend: str, setting: str, threads: int, b32: float) -> dict:
    setup = {"variant": variant, "backend": backend, "setting": setting, "threads": threads}
    return {"setup": setup, "status": "ok", "metrics": {"throughput_b32": b32, "p50_ms": 1.0, "accuracy": 0.99}}


def test_headline_ratios_are_against_each_eager_baseline_at_its_better_thread_count() -> None:
    # On AVX-512 machines eager can be slower with all threads than with one: the baseline takes the faster.
    results = [
        _timed("fp32", "torch-eager", "onednn-off", 0, 800.0),
        _timed("fp32", "torch-eager", "onednn-off", 1, 1000.0),
        _timed("fp32", "torch-eager", "onednn-on", 0, 3000.0),
        _timed("fp32", "torch-eager", "onednn-on", 1, 2000.0),
        _timed("student-int8-onnx", "onnxruntime", "default", 0, 30000.0),
    ]
    chosen = {**results[-1]["setup"], "metrics": results[-1]["metrics"]}
    report = {"results": results, "chosen": chosen, "machine": {"isa": ["avx512f", "amx_int8"]}}
    out = reports.headline(report, 32)
    assert out["speedup_b32_vs_default_eager"] == 10.0 and out["default_eager_threads"] == "all"
    assert out["speedup_b32_vs_eager_onednn_off"] == 30.0
    assert out["isa"] == "avx512f amx_int8"


def test_served_headline_shows_headlines_figures_unrounded_at_batch_32_only() -> None:
    """MLflow's headline names are at batch 32: the figures metrics.json rounds, exact; a run that timed no batch of
    32 (benchmark.batch_sizes: [64]) has no throughput or speed-up there, and its other figures still go."""
    results = [
        _timed("fp32", "torch-eager", "onednn-on", 0, 3000.0),
        _timed("int8-onnx", "onnxruntime", "default", 0, 10001.0),
    ]
    chosen = {**results[-1]["setup"], "metrics": {**results[-1]["metrics"], "p99_ms": 2.5}}
    rounds = {"batch": 32, "median": 3.14159, "low": 2.5, "high": 3.9, "rounds": 3}
    report = {
        "results": results,
        "chosen": chosen,
        "machine": {},
        "chosen_served_accuracy": 0.98765,
        "headline": rounds,
    }
    manifest = SimpleNamespace(variants=[SimpleNamespace(name="int8-onnx", size_bytes=1024)])
    result = Result(Setup(**results[-1]["setup"]), "ok", metrics=chosen["metrics"])
    assert reports.served_headline(report, manifest, result) == {
        "served_throughput_b32": 10001.0, "served_p50_ms": 1.0, "served_p99_ms": 2.5, "served_size_bytes": 1024.0,
        "served_accuracy": 0.98765, "speedup_b32_vs_default_eager": 3.14159, "speedup_b32_vs_default_eager_low": 2.5,
        "speedup_b32_vs_default_eager_high": 3.9,
    }  # fmt: skip
    assert reports.headline(report, 32)["speedup_b32_vs_default_eager"] == 3.14
    assert reports.headline({**report, "headline": None}, 32)["speedup_b32_vs_default_eager"] == 3.33

    for r in [*results, chosen]:
        r["metrics"]["throughput_b64"] = r["metrics"].pop("throughput_b32")
    report["headline"] = {**rounds, "batch": 64}
    assert reports.served_headline(report, manifest, result) == {
        "served_p50_ms": 1.0,
        "served_p99_ms": 2.5,
        "served_size_bytes": 1024.0,
        "served_accuracy": 0.98765,
    }
    out = reports.headline(report, 64)
    assert out["served_throughput_b64"] == 10001.0 and out["speedup_b64_vs_default_eager"] == 3.14


def test_the_stage_completes_when_no_batch_of_32_is_timed(
    tiny_project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """benchmark.batch_sizes: [64]: the reports, the choice and the headline are at batch 64; the stage no longer
    fails after writing its reports for want of a batch-32 figure."""
    import shutil

    import yaml

    from pipeline.config import parse_params
    from pipeline.stages import benchmark

    work = tmp_path / "project"
    shutil.copytree(tiny_project, work, symlinks=True)
    raw = yaml.safe_load((work / "params.yaml").read_text())
    raw["benchmark"] = {"threads": [0], "batch_sizes": [64], "min_seconds": 0.05, "latency_calls": 5, "warmup": 1,
                        "backends": ["onnxruntime", "torch-eager"], "max_accuracy_drop": 0.05, "headline_rounds": 1,
                        "profile": False}  # fmt: skip
    logged: list[dict[str, float]] = []
    monkeypatch.setattr(
        benchmark, "served_headline", lambda *a: logged.append(reports.served_headline(*a)) or logged[-1]
    )
    monkeypatch.chdir(work)
    benchmark.run(parse_params(raw))

    metrics = json.loads(Path("reports/benchmark/metrics.json").read_text())
    assert metrics["served_throughput_b64"] > 0 and metrics["headline_rounds"] == 1
    assert metrics["speedup_b64_vs_default_eager"] > 0 and "b32" not in "".join(metrics)
    assert "| img/s b64 |" in Path("reports/benchmark/table.md").read_text()
    assert json.loads(Path("models/serving.json").read_text())["metrics"]["throughput_b64"] > 0
    assert len(logged) == 1 and logged[0]["served_p50_ms"] > 0 and not any("b32" in name for name in logged[0])


def test_per_variant_table_rates_each_variant_against_default_eager_and_the_roofline() -> None:
    results = [
        _timed("fp32", "torch-eager", "onednn-on", 0, 1000.0),
        _timed("fp32", "torch-eager", "onednn-on", 1, 600.0),
        _timed("fp32-onnx", "onnxruntime", "default", 0, 2500.0),
        _timed("pruned-int8-onnx", "onnxruntime", "default", 0, 15000.0),
        _timed("pruned-int8-onnx", "onnxruntime", "default", 1, 9000.0),
    ]
    report = {
        "results": results,
        "variants": [
            {"name": "fp32", "macs": 80_000_000, "parameters": 586006, "size_bytes": 2048, "served_accuracy": 0.995},
            {"name": "fp32-onnx", "macs": 80_000_000, "parameters": 586006, "size_bytes": 2048,
             "served_accuracy": 0.995},
            {"name": "pruned-int8-onnx", "macs": 20_000_000, "parameters": 221123, "size_bytes": 1024,
             "served_accuracy": 0.99},
            {"name": "student", "macs": None, "parameters": 1, "size_bytes": 1024, "served_accuracy": None},
        ],
        "sgemm_gmacs": {"torch.mm": 50.0, "onnxruntime MatMul": 100.0},  # the faster is the roofline
    }  # fmt: skip
    rows = {line.split(" | ")[0]: line for line in reports.per_variant_table(report, 32) if line.startswith("| ")}
    # fastest all-core setup; 15,000 img/s x 20 M MACs = 300 GMAC/s = 3x the fp32 sgemm rate (int8 can pass it)
    assert rows["| pruned-int8-onnx"] == (
        "| pruned-int8-onnx | 20.0 M | 221,123 | 1.0 KiB | 0.9900 | onnxruntime / default | 1.000 | 15,000 | – | "
        "15.00× | 300.0 | 300 % |"
    )
    assert "| 2.50× | 200.0 | 200 % |" in rows["| fp32-onnx"] and "| 1.00× | 80.0 | 80 % |" in rows["| fp32"]
    assert rows["| student"].endswith("not timed | | | | | | |")
    assert rows["| roofline: fp32 sgemm"].endswith("| onnxruntime MatMul / all cores | – | – | – | – | 100.0 | 100 % |")
    assert reports.per_variant_table({"results": results}, 32) == []  # older reports: no table


def test_variant_macs_follow_the_source_chain() -> None:
    def v(name: str, source: str = "", **details: object) -> SimpleNamespace:
        return SimpleNamespace(name=name, source=source, details=details)

    variants = [v("fp32", macs=100), v("bf16", "fp32"), v("fp32-onnx", "fp32"), v("int8-onnx", "fp32-onnx"),
                v("int8-pt2e", "fp32"), v("pruned", macs=30), v("pruned-int8-onnx", "pruned-onnx"), v("pruned-onnx", "pruned"),
                v("orphan", "missing"), v("loop", "loop")]  # fmt: skip
    macs = {x.name: reports.variant_macs(x, variants) for x in variants}
    assert macs == {"fp32": 100, "bf16": 100, "fp32-onnx": 100, "int8-onnx": 100, "int8-pt2e": 100, "pruned": 30,
                    "pruned-int8-onnx": 30, "pruned-onnx": 30, "orphan": None, "loop": None}  # fmt: skip


def test_no_servable_variant_is_said_plainly() -> None:
    """efficientnet_b0 after one epoch: no ONNX variant passed optimize's gates, only torch ones shipped. The
    benchmark says that, with optimize's reasons, rather than that no setup passed its own accuracy gate."""
    from pipeline.artifacts.variants import Variant
    from pipeline.benchmarking.choice import no_servable_setup

    def variant(name: str, fmt: str, runtimes: list[str], reason: str = "") -> Variant:
        return Variant(
            name=name, file="" if reason else f"{name}.x", format=fmt, runtimes=runtimes, precision="fp32",
            accuracy=0.5, accuracy_drop=0.0, size_bytes=1, sha256="", parameters=1, accepted=not reason,
            reason=reason, source="fp32",
        )  # fmt: skip

    variants = [
        variant("fp32", "torch-state-dict", ["torch-eager", "torch-compile"]),
        variant("fp32-onnx", "onnx", ["onnxruntime"], "parity with fp32 failed"),
        variant("int8-onnx", "onnx", ["onnxruntime"], "accuracy drop 15.90 points > 0.50 allowed"),
    ]
    message = no_servable_setup(variants, BenchmarkConfig())
    assert message.startswith("optimize shipped no variant that runs on onnxruntime")
    assert "fp32-onnx: parity with fp32 failed" in message and "int8-onnx: accuracy drop 15.90" in message
    assert "Shipped, on other backends: fp32" in message
    variants[1] = variant("fp32-onnx", "onnx", ["onnxruntime"])  # shipped, but lost accuracy in the benchmark
    assert no_servable_setup(variants, BenchmarkConfig()).startswith("no setup among onnxruntime passed")
