"""`python -m benchmarks TOOL ...`: the measurement lab, run from a checkout of the repository.

Each tool compares setups side by side in one run (ratios; see each tool's --help). The lab sits beside the package:
no product module imports it, and neither the wheel, the server image nor a generated project carries it.
"""

from __future__ import annotations

import typer

from pipeline.cli import PASS_THROUGH, _tool  # the same pass-through the product's CLI uses

app = typer.Typer(
    name="python -m benchmarks",
    help="Benchmarks measured side by side in one run (ratios; see each tool's --help).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command("train", context_settings=PASS_THROUGH)
def bench_train(ctx: typer.Context) -> None:
    """Training throughput: loader, step, eager vs compile vs bf16, 1 vs 2 processes (DDP, FSDP)."""
    _tool("benchmarks.train", ctx)


@app.command("roofline", context_settings=PASS_THROUGH)
def bench_roofline(ctx: typer.Context) -> None:
    """How close each runtime gets to this CPU's matrix-multiply rate (GFLOP/s)."""
    _tool("benchmarks.roofline", ctx)


@app.command("serve", context_settings=PASS_THROUGH)
def bench_serve(ctx: typer.Context) -> None:
    """Load-test the server (batching, no batching, the Arm learning-path reference) on loopback."""
    _tool("benchmarks.serve", ctx)


@app.command("memory", context_settings=PASS_THROUGH)
def bench_memory(ctx: typer.Context) -> None:
    """Peak RSS, wall time and CPU use of a command (benchmarks/memory.py)."""
    _tool("benchmarks.memory", ctx)


@app.command("scale-folder", context_settings=PASS_THROUGH)
def bench_scale_folder(ctx: typer.Context) -> None:
    """A large folder of photo-sized JPEGs made from the demo data (benchmarks/scale_folder.py)."""
    _tool("benchmarks.scale_folder", ctx)


@app.command("formats", context_settings=PASS_THROUGH)
def bench_formats(ctx: typer.Context) -> None:
    """The prepared .npy shards against LitData, MDS and WebDataset: write, read an epoch shuffled (benchmarks/formats.py)."""
    _tool("benchmarks.formats", ctx)


@app.command("remote-read", context_settings=PASS_THROUGH)
def bench_remote_read(ctx: typer.Context) -> None:
    """Rows a second from your DVC remote: concurrent ranges against one read a row (benchmarks/remote_read.py)."""
    _tool("benchmarks.remote_read", ctx)


@app.command("decode", context_settings=PASS_THROUGH)
def bench_decode(ctx: typer.Context) -> None:
    """The server's decode per image, side by side: PNG libspng vs PIL, or JPEG full vs reduced (benchmarks/decode.py)."""
    _tool("benchmarks.decode", ctx)


@app.command("cpu-split", context_settings=PASS_THROUGH)
def bench_cpu_split(ctx: typer.Context) -> None:
    """Where a server's Python time goes, from a py-spy raw profile (benchmarks/cpu_split.py)."""
    _tool("benchmarks.cpu_split", ctx)


@app.command("frontend", context_settings=PASS_THROUGH)
def bench_frontend(ctx: typer.Context) -> None:
    """The HTTP front end alone: uvicorn tuned against Granian on a null route (benchmarks/frontend.py)."""
    _tool("benchmarks.frontend", ctx)


@app.command("drift", context_settings=PASS_THROUGH)
def bench_drift(ctx: typer.Context) -> None:
    """What the server's drift signals cost per request (benchmarks/drift.py)."""
    _tool("benchmarks.drift", ctx)


@app.command("models", context_settings=PASS_THROUGH)
def bench_models(ctx: typer.Context) -> None:
    """One row per network on your folder: dvc repro evaluate per network, training time, served accuracy, speed."""
    _tool("benchmarks.models", ctx)


@app.command("gpu", context_settings=PASS_THROUGH)
def bench_gpu(ctx: typer.Context) -> None:
    """Inference (eager fp32/bf16, compiled, CUDA graphs, ONNX Runtime CUDA) and training on the GPU beside the CPU."""
    _tool("benchmarks.gpu", ctx)


@app.command("accuracy", context_settings=PASS_THROUGH)
def bench_accuracy(ctx: typer.Context) -> None:
    """The trained model on a labelled folder of image files: served (whole files) vs ROI accuracy, 95 % CI."""
    _tool("benchmarks.accuracy", ctx)


@app.command("frozen-probe", context_settings=PASS_THROUGH)
def bench_frozen_probe(ctx: typer.Context) -> None:
    """A linear head on a packaged backbone's frozen features: k-fold over a folder, or scored on a test folder."""
    _tool("benchmarks.frozen_probe", ctx)


@app.command("served-folder", context_settings=PASS_THROUGH)
def bench_served_folder(ctx: typer.Context) -> None:
    """A running server's accuracy on a labelled folder of files, one file a request to /v1/predict (httpx)."""
    _tool("benchmarks.served_folder", ctx)


if __name__ == "__main__":
    app()
