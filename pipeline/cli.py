"""`pipeline` command: one subcommand per stage. Loads and validates params, calls the stage's run().

No logic of its own: DVC, the tests and this CLI all call the same `run(params)` entries
(pipeline/stages/<stage>.py; `serve` and `monitor` are commands, not DVC stages: pipeline/serve/main.py, pipeline/monitoring/probe.py).
`pipeline image-context` passes its options to that tool; the measurement lab is beside the package:
`python -m benchmarks --help` (benchmarks/, not installed with the package).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import NoReturn

import typer
from pydantic import ValidationError

from pipeline.config import ConfigError, Params, load_params
from pipeline.errors import StageError

app = typer.Typer(
    name="pipeline",
    help="MLOps image-classification pipeline: prepare, train, optimize, benchmark, evaluate, card, containerize, deploy; serve, monitor, predict.",
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
    stage = importlib.import_module(module if "." in module else f"pipeline.stages.{module}")
    try:
        stage.run(params)
    except StageError as exc:
        _fail(str(exc))


@app.command("params")
def show_params(params_path: Path = ParamsOption) -> None:
    """Print the params a run uses (params.yaml over the recipe over the defaults) and where each value came from."""
    import yaml

    from pipeline.config import explain

    try:
        rows = explain(yaml.safe_load(params_path.read_text()) if params_path.is_file() else {})
    except ConfigError as exc:
        _fail(str(exc))
    for key, value, origin in rows:
        typer.echo(f"{key} = {value!r}  ({origin})" if origin != "default" else f"{key} = {value!r}")


@app.command()
def prepare(params: Path = ParamsOption) -> None:
    """Read the labelled images, crop, resize, split by group; write uint8 arrays and a manifest."""
    _run_stage("prepare", params)


@app.command()
def weights(params: Path = ParamsOption) -> None:
    """Resolve model.weights (a package's, the library's cache or Hub, a file) and record its sha256 for train."""
    _run_stage("weights", params)


@app.command()
def train(params: Path = ParamsOption) -> None:
    """Train the model (resumable; several processes with train.nproc)."""
    _run_stage("train", params)


@app.command()
def evaluate(params: Path = ParamsOption) -> None:
    """Accuracy, per-class accuracy, macro F1 and confusion matrix on the test split; quality gate."""
    _run_stage("evaluate", params)


@app.command()
def promote(
    version: str = typer.Option(
        "", help="A registered version to point `champion` at (default: what evaluate passed)."
    ),
    params: Path = ParamsOption,
) -> None:
    """Point the registry's `champion` alias at the variant evaluate's gate passed (or at --version): what is released."""
    from pipeline.artifacts import gate as gate_file
    from pipeline.tracking import promote as promote_champion

    loaded = _load(params)
    try:
        gate = None if version else gate_file.read()
        if gate is not None and not gate.passed:
            raise StageError(f"evaluate's gate failed {gate.variant}: {gate.failures()}; nothing to promote")
        moved = promote_champion(loaded, version, *((gate.variant, gate.sha256) if gate else ()))
    except StageError as exc:
        _fail(str(exc))
    typer.echo(f"{loaded.tracking.registered_model_name} version {moved} is the champion")


@app.command()
def optimize(params: Path = ParamsOption) -> None:
    """Prune, quantize and export the trained model into verified variants."""
    _run_stage("optimize", params)


@app.command()
def benchmark(params: Path = ParamsOption) -> None:
    """Time every variant on every backend this machine has; choose the serving default."""
    _run_stage("benchmark", params)


@app.command()
def tune(params: Path = ParamsOption) -> None:
    """Search tune.space with Optuna on the validation split (pruned trials stop early; resumable, shareable)."""
    _run_stage("pipeline.tune", params)


@app.command()
def card(params: Path = ParamsOption) -> None:
    """Write the model card (reports/model_card.md) of the shipped model from the pipeline's artifacts."""
    _run_stage("card", params)


@app.command()
def compare(
    reports: list[Path] = typer.Argument(..., help="Benchmark report.json files, e.g. from the x86 and Arm runners."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Also write the markdown table here."),
) -> None:
    """Merge benchmark reports of several machines into one table with ratios against each baseline."""
    from pipeline.stages.benchmark import compare as merge_reports

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


@app.command()
def monitor(
    params: Path = ParamsOption,
    url: str | None = typer.Option(
        None, "--url", "-u", help="Server base URL (else $PIPELINE_MONITOR_URL, else monitor.url)."
    ),
    images: int | None = typer.Option(None, help="Override monitor.images (0 = all)."),
    drift: bool = typer.Option(
        False, "--drift", help="Check drift instead: the server's live signals against its drift reference."
    ),
    window: float | None = typer.Option(
        None, "--window", min=0, help="--drift: seconds of traffic (monitor.drift.window_s)."
    ),
    prometheus: str | None = typer.Option(
        None, "--prometheus", help="--drift: read the signals from this Prometheus server (all replicas)."
    ),
    reference: Path | None = typer.Option(
        None, "--reference", help="--drift: this drift_reference.json instead of the server's /v1/drift-reference."
    ),
) -> None:
    """Probe a running server with labelled images and its /metrics; fail on a threshold breach.
    With --drift: compare the server's live drift signals with its reference; fail naming each drifted signal."""
    loaded = _load(params, "monitor", {"images": images})
    try:
        if drift:
            from pipeline.monitoring import drift_check

            drift_check.run(loaded, url=url, prometheus=prometheus, reference_path=reference, window_s=window)
        else:
            from pipeline.monitoring import probe

            probe.run(loaded, url=url)
    except StageError as exc:
        _fail(str(exc))


@app.command()
def samples(
    log_dir: Path = typer.Argument(..., help="The server's serve.sample_log.dir (or a copy of it)."),
    to: Path = typer.Option(Path("review"), "--to", help="Review folder: one sub-folder per answered class."),
    below: float = typer.Option(
        1.0, "--below", min=0.0, max=1.0, help="Only files whose top-1 probability is at most this."
    ),
) -> None:
    """The server's sample log as a review folder in the data-folder layout: move each file to its right class,
    then add the folder to your data (its classes' folders) and `dvc repro`."""
    from pipeline.serve.sample_log import review_folder

    if not log_dir.is_dir():
        _fail(f"{log_dir} is not a folder: give serve.sample_log.dir of a server that logged samples")
    counts = review_folder(log_dir, to, below)
    if not counts:
        _fail(f"no logged files with top-1 probability <= {below} under {log_dir}")
    print(
        f"{sum(counts.values())} files in {len(counts)} class folders under {to}: "
        + ", ".join(f"{name} {n}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1])[:8])
    )


@app.command()
def predict(
    paths: list[str] = typer.Argument(..., help="Image files, folders (searched recursively) or globs."),
    params: Path = ParamsOption,
    model: str | None = typer.Option(
        None, "--model", help="Variant to use (default: serve.variant, i.e. the benchmark's choice)."
    ),
    url: str | None = typer.Option(None, "--url", help="Classify through a running server instead (its /v1/predict)."),
    top_k: int = typer.Option(3, "--top-k", min=1, max=256, help="Classes per file."),
    as_json: bool = typer.Option(False, "--json", help="JSON lines instead of a table."),
) -> None:
    """Classify image files with the served model (the server's own preprocessing), or through a server."""
    loaded = _load(params)
    from pipeline.serve import predict as predictor

    try:
        code = predictor.run(loaded, paths, url, model, top_k, as_json)
    except StageError as exc:
        _fail(str(exc))
    if code:
        raise typer.Exit(code=code)


@app.command()
def serve(
    params: Path = ParamsOption,
    host: str | None = typer.Option(None, help="Override serve.host (e.g. 0.0.0.0 in a container)."),
    port: int | None = typer.Option(None, help="Override serve.port."),
    grpc_port: int | None = typer.Option(None, help="Override serve.grpc_port (OIP v2 over gRPC; 0 = off)."),
    variant: str | None = typer.Option(None, help="Override serve.variant."),
    backend: str | None = typer.Option(None, help="Override serve.backend."),
    max_batch_size: int | None = typer.Option(None, help="Override serve.max_batch_size (1 = no batching)."),
    threads: int | None = typer.Option(None, help="Override serve.threads (e.g. the pod's CPU limit)."),
    champion: bool = typer.Option(
        False, "--champion", help="Serve the model registry's champion (downloaded, checked by sha256), not models/."
    ),
) -> None:
    """Serve the chosen model over HTTP (Open Inference Protocol v2 and /v1/predict), and gRPC (OIP v2) if asked."""
    overrides: dict[str, object] = {
        "host": host,
        "port": port,
        "grpc_port": grpc_port,
        "variant": variant,
        "backend": backend,
        "max_batch_size": max_batch_size,
        "threads": threads,
        "champion": champion or None,
    }
    _run_stage("pipeline.serve.main", params, overrides)


PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def _tool(module: str, ctx: typer.Context) -> None:
    """Run a tool's argparse main() with the remaining command-line arguments."""
    code = importlib.import_module(module).main(list(ctx.args))
    if code:
        raise typer.Exit(code=int(code))


@app.command("image-context", context_settings=PASS_THROUGH)
def image_context(ctx: typer.Context) -> None:
    """Stage the server image's build context for several platforms (release.yml's buildx build)."""
    _tool("pipeline.ship.image_context", ctx)


platform_app = typer.Typer(
    help="The team tracking stack (PostgreSQL + SeaweedFS S3 + MLflow server): processes here (up, down) or containers "
    "(image, then deploy/platform/compose.yaml)."
)
app.add_typer(platform_app, name="platform")
PlatformDir = typer.Option(Path(".platform"), "--dir", help="Where the stack keeps its data, logs and credentials.")


@platform_app.command("up")
def platform_up(
    folder: Path = PlatformDir,
    postgres_port: int = typer.Option(55432, help="PostgreSQL on 127.0.0.1."),
    s3_port: int = typer.Option(8333, help="SeaweedFS's S3 gateway on 127.0.0.1."),
    mlflow_port: int = typer.Option(5051, help="The MLflow tracking server on 127.0.0.1."),
    workers: int = typer.Option(2, help="MLflow server worker processes."),
) -> None:
    """Start the stack (data kept in --dir across restarts); prints the environment clients need."""
    from pipeline.tracking import team_stack

    try:
        stack = team_stack.up(folder, team_stack.Ports(postgres_port, s3_port, mlflow_port), workers)
    except StageError as exc:
        _fail(str(exc))
    typer.echo(f"MLflow {stack.tracking_uri} (PostgreSQL :{postgres_port}, S3 {stack.s3_endpoint}); data in {folder}")
    typer.echo(f"clients: export {team_stack.client_env(stack).strip()}   (also in {folder / 'client.env'})")
    typer.echo("DVC remote on its S3 bucket: pipeline platform dvc-remote")


@platform_app.command("down")
def platform_down(folder: Path = PlatformDir) -> None:
    """Stop the stack started from --dir; its data stays."""
    from pipeline.tracking import team_stack

    typer.echo("stopped" if team_stack.down(folder) else f"no stack running from {folder}")


@platform_app.command("dvc-remote")
def platform_dvc_remote(
    folder: Path = PlatformDir,
    name: str = typer.Option("team", help="Remote name."),
    endpoint: str = typer.Option(
        "",
        help="The S3 gateway's URL, for the compose stack (e.g. http://127.0.0.1:8333); default: the running stack's.",
    ),
) -> None:
    """Make the stack's S3 bucket this repository's default DVC remote (keys in .dvc/config.local, git-ignored)."""
    from pipeline.tracking import team_stack

    if endpoint:
        credentials = team_stack.Credentials.load(folder)
    else:
        stack = team_stack.Stack.read(folder)
        if stack is None:
            _fail(f"no stack running from {folder}: `pipeline platform up` first (or --endpoint for the compose stack)")
        endpoint, credentials = stack.s3_endpoint, stack.credentials
    try:
        team_stack.dvc_remote(endpoint, credentials, Path.cwd(), name)
    except StageError as exc:
        _fail(str(exc))
    typer.echo(f"dvc remote {name!r}: {team_stack.DVC_URL} at {endpoint}; `dvc push` / `dvc pull`")


@platform_app.command("image")
def platform_image(
    folder: Path = PlatformDir,
    tag: str = typer.Option("gtsrb-platform:latest", help="Image tag (compose.yaml: PLATFORM_IMAGE)."),
    base_image: str = typer.Option(
        "local/python:3.11-slim-bookworm", help="Base with python3 3.11 + venv (docker/base-image.sh builds this one)."
    ),
) -> None:
    """Build the image deploy/platform/compose.yaml runs; make sure --dir/credentials.env exists for --env-file."""
    from pipeline.tracking import team_stack

    try:
        seconds = team_stack.build_image(tag, base_image)
    except StageError as exc:
        _fail(str(exc))
    team_stack.Credentials.load(folder)
    typer.echo(f"built {tag} in {seconds:.0f} s; credentials in {folder / 'credentials.env'}")
    typer.echo(f"docker compose -f deploy/platform/compose.yaml --env-file {folder / 'credentials.env'} up -d")


if __name__ == "__main__":
    app()
