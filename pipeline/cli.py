"""`pipeline` command: one subcommand per stage. Loads and validates params, calls the stage's run().

No logic of its own: DVC, the tests and this CLI all call the same `run(params)` entries.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import NoReturn

import typer
from pydantic import ValidationError

from pipeline.config import ConfigError, Params, load_params, set_params
from pipeline.errors import StageError

app = typer.Typer(
    name="pipeline",
    help="GTSRB MLOps pipeline: prepare, train, evaluate, optimize, benchmark, containerize, deploy; serve, monitor.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ParamsOption = typer.Option(Path("params.yaml"), "--params", "-p", help="Parameters file.")


def _fail(message: str) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


def _load(params_path: Path, section: str = "", overrides: dict[str, object] | None = None) -> Params:
    """Validated params, with command-line `overrides` (None = not given) applied to one section."""
    try:
        params: Params = load_params(params_path)
        given = {k: v for k, v in (overrides or {}).items() if v is not None}
        if given:
            current = getattr(params, section)
            merged = current.model_dump() | given
            params = params.model_copy(update={section: type(current).model_validate(merged)})
    except ConfigError as exc:
        _fail(str(exc))
    except ValidationError as exc:
        _fail("; ".join(f"{section}.{e['loc'][0]}: {e['msg']}" for e in exc.errors()))
    return params


def _run_stage(module: str, params_path: Path, serve_overrides: dict[str, object] | None = None) -> None:
    """Validate params, import the stage lazily (importing `pipeline` stays fast), run it."""
    params = _load(params_path, "serve", serve_overrides)
    stage = importlib.import_module(f"pipeline.{module}")
    try:
        stage.run(params)
    except StageError as exc:
        _fail(str(exc))


@app.command()
def prepare(params: Path = ParamsOption) -> None:
    """Read GTSRB, crop to the sign, resize, split by track; write uint8 arrays and a manifest."""
    _run_stage("prepare", params)


@app.command()
def train(params: Path = ParamsOption) -> None:
    """Train the model (resumable; several processes with train.nproc)."""
    _run_stage("train", params)


@app.command()
def evaluate(params: Path = ParamsOption) -> None:
    """Accuracy, per-class accuracy, macro F1 and confusion matrix on the test split; quality gate."""
    _run_stage("evaluate", params)


@app.command()
def optimize(params: Path = ParamsOption) -> None:
    """Prune, quantize and export the trained model into verified variants."""
    _run_stage("optimize", params)


@app.command()
def benchmark(params: Path = ParamsOption) -> None:
    """Time every variant on every backend this machine has; choose the serving default."""
    _run_stage("benchmark", params)


@app.command()
def compare(
    reports: list[Path] = typer.Argument(..., help="Benchmark report.json files, e.g. from the x86 and Arm runners."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Also write the markdown table here."),
) -> None:
    """Merge benchmark reports of several machines into one table with ratios against each baseline."""
    from pipeline.benchmark import compare as merge_reports

    try:
        table = merge_reports(reports)
    except StageError as exc:
        _fail(str(exc))
        return
    typer.echo(table)
    if output:
        output.write_text(table)


@app.command()
def containerize(params: Path = ParamsOption) -> None:
    """Build the inference server image with the chosen model."""
    _run_stage("containerize", params)


@app.command()
def deploy(params: Path = ParamsOption) -> None:
    """Run the image, smoke-test it through the API on real test images."""
    _run_stage("deploy", params)


@app.command("set-params")
def set_params_command(
    assignments: list[str] = typer.Argument(..., help="SECTION.KEY=VALUE (YAML value), e.g. train.epochs=2."),
    params: Path = ParamsOption,
) -> None:
    """Change parameters in params.yaml in place (comments kept), validated first: for one-off runs such as CI's."""
    try:
        set_params(params, assignments)
    except ConfigError as exc:
        _fail(str(exc))
        return
    typer.echo(f"{params}: set {', '.join(a.split('=', 1)[0] for a in assignments)}")


@app.command()
def monitor(
    params: Path = ParamsOption,
    url: str | None = typer.Option(
        None, "--url", "-u", help="Server base URL (else $PIPELINE_MONITOR_URL, else monitor.url)."
    ),
    images: int | None = typer.Option(None, help="Override monitor.images (0 = all)."),
) -> None:
    """Probe a running server with labelled images and its /metrics; fail on a threshold breach."""
    loaded = _load(params, "monitor", {"images": images})
    from pipeline import monitor as probe

    try:
        probe.run(loaded, url=url)
    except StageError as exc:
        _fail(str(exc))


@app.command()
def serve(
    params: Path = ParamsOption,
    host: str | None = typer.Option(None, help="Override serve.host (e.g. 0.0.0.0 in a container)."),
    port: int | None = typer.Option(None, help="Override serve.port."),
    variant: str | None = typer.Option(None, help="Override serve.variant."),
    backend: str | None = typer.Option(None, help="Override serve.backend."),
    max_batch_size: int | None = typer.Option(None, help="Override serve.max_batch_size (1 = no batching)."),
    threads: int | None = typer.Option(None, help="Override serve.threads (e.g. the pod's CPU limit)."),
) -> None:
    """Serve the chosen model over HTTP (Open Inference Protocol v2 and /v1/predict)."""
    overrides: dict[str, object] = {
        "host": host,
        "port": port,
        "variant": variant,
        "backend": backend,
        "max_batch_size": max_batch_size,
        "threads": threads,
    }
    _run_stage("serve", params, overrides)


if __name__ == "__main__":
    app()
