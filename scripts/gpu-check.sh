#!/usr/bin/env bash
# The CUDA paths end to end, on a GPU machine with torch + CUDA preinstalled and no network, in one call:
# prepare -> train (train.device cuda, amp bf16, torch.compile; DDP over the GPUs when there are several) ->
# optimize -> benchmark (the CPU rows) -> evaluate (the original files) -> `python -m benchmarks gpu` (eager fp32 / bf16,
# compiled, CUDA graphs, ONNX Runtime's CUDA provider at batch 1, 32, 256, 1024, and the training step, beside the
# CPU). Everything lands in OUT (JSON + Markdown); it never waits for input.
#
#   scripts/gpu-check.sh [--dry-run] [OUT]      (default OUT: gpu-check/)
#
# Your own network instead of the demo's: GPU_CHECK_MODEL=torchvision/resnet18 GPU_CHECK_SIZE=224 (model.name and
# data.image_size); GPU_CHECK_STAGES="prepare train" runs only those stages before `python -m benchmarks gpu` (which then
# measures the trained network: inference beside the CPU, and its own training step).
#
# Data: $GTSRB_ROOT when set (the full training split if it travels with the tree), else data/raw, else the shared
# sample (shared/data/gtsrb-sample or ../shared/data/gtsrb-sample). --dry-run: the same steps on the CPU, tiny (CI
# runs it so the script cannot rot where no GPU is lent); its figures mean nothing.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
dry=false
if [ "${1:-}" = --dry-run ]; then dry=true; shift; fi
out="$(mkdir -p "${1:-gpu-check}" && cd "${1:-gpu-check}" && pwd)"
python="${PYTHON:-$(command -v python3)}"
[ -x "$repo/.venv/bin/python" ] && [ -z "${PYTHON:-}" ] && python="$repo/.venv/bin/python"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" MLFLOW_TRACKING_URI= PYTHONUNBUFFERED=1
started=$(date +%s)
step() { echo "[gpu-check $(( $(date +%s) - started ))s] $*" | tee -a "$out/steps.log"; }

# What the package needs that this machine lacks: named at once, not as a traceback halfway through.
missing=$("$python" - <<'EOF'
import importlib.util
need = ["torch", "torchvision", "numpy", "PIL", "pydantic", "yaml", "typer", "rich", "onnx", "onnxscript",
        "onnxruntime", "matplotlib", "timm", "safetensors", "torch_pruning", "orjson", "httpx", "python_multipart"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
EOF
)
if [ -n "$missing" ]; then
  echo "gpu-check: missing Python packages: $missing (carry their wheels: see the device README)" | tee "$out/steps.log" >&2
  exit 3
fi

root="${GTSRB_ROOT:-}"
for candidate in "$repo/data/raw" "$repo/shared/data/gtsrb-sample" "$repo/../shared/data/gtsrb-sample"; do
  if [ -z "$root" ] && [ -d "$candidate/gtsrb/GTSRB/Training" ]; then root="$(cd "$candidate" && pwd)"; fi
done
if [ -z "$root" ]; then echo "gpu-check: no GTSRB copy: set GTSRB_ROOT" >&2; exit 3; fi

work="$out/project"
rm -rf "$work" && mkdir -p "$work"
cd "$work"
gpus=$("$python" -c "import torch; print(torch.cuda.device_count())")
if $dry; then device=cpu; nproc=1; else device=cuda; nproc=$(( gpus > 0 ? gpus : 1 )); fi
"$python" - "$repo/params.yaml" "$root" "$device" "$nproc" "$dry" "${GPU_CHECK_MODEL:-}" "${GPU_CHECK_SIZE:-}" > params.yaml <<'EOF'
import sys, yaml
params = yaml.safe_load(open(sys.argv[1]))
root, device, nproc, dry = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "true"
model, size = sys.argv[6], sys.argv[7]
params["data"].update(root=root, download=False)
if model:
    params["model"]["name"] = model
if size:
    params["data"]["image_size"] = int(size)
params["train"].update(device=device, amp="bf16", compile=True, nproc=nproc, checkpoint_every=0)
params["optimize"].update(finetune_epochs=2, int8_torch=False)
params["benchmark"].update({"batch_sizes": [32, 256], "threads": [0], "min_seconds": 0.5, "profile": False})
params["containerize"]["variant"] = "fp32-onnx"  # evaluate measures this file (the benchmark's choice may differ)
params["tracking"]["enabled"] = False
params["evaluate"]["min_accuracy"] = 0.0  # the check is about the CUDA paths; the accuracy is reported, not gated
if dry:  # the same steps, tiny, on the CPU
    params["model"].update(width=8, members=1)
    params["train"].update(epochs=1, compile=False, amp="off")
    params["evaluate"]["min_accuracy"] = 0.0
    params["optimize"].update(prune_amount=0.0, calibration_images=64, max_accuracy_drop=1.0, bf16="off")
    params["benchmark"].update({"batch_sizes": [32], "min_seconds": 0.05, "latency_calls": 5, "warmup": 1,
                                "backends": ["onnxruntime"], "max_accuracy_drop": 1.0})
print(yaml.safe_dump(params))
EOF

run_stage() {
  step "pipeline $1"
  "$python" -m pipeline.cli "$1" -p params.yaml > "$out/$1.log" 2>&1 || { tail -20 "$out/$1.log" >&2; echo "gpu-check: $1 failed (log: $out/$1.log)" >&2; exit 1; }
}
stages="${GPU_CHECK_STAGES:-prepare train optimize benchmark evaluate}"
for stage in $stages; do run_stage "$stage"; done
step "python -m benchmarks gpu"
if $dry; then flags=(--dry-run); else flags=(--seconds 0.5); fi
[ -n "${GPU_CHECK_BENCH_FLAGS:-}" ] && read -ra extra <<< "$GPU_CHECK_BENCH_FLAGS" && flags+=("${extra[@]}")
"$python" -m benchmarks gpu "${flags[@]}" --out "$out" > "$out/bench-gpu.log" 2>&1 || { tail -20 "$out/bench-gpu.log" >&2; exit 1; }

"$python" - "$out" "$dry" "$device" "$nproc" "$stages" > "$out/summary.md" <<'EOF'
import json, sys
from pathlib import Path
out, dry, device, nproc = Path(sys.argv[1]), sys.argv[2] == "true", sys.argv[3], sys.argv[4]
work = out / "project" / "reports"
train = json.loads((work / "train/metrics.json").read_text())
evaluated = work / "evaluate/metrics.json"
evaluation = json.loads(evaluated.read_text()) if evaluated.exists() else None
print(f"# gpu-check{' (DRY RUN on the CPU: figures mean nothing)' if dry else ''}\n")
print(f"- train: device {train['device']}, {nproc} process(es), {train['epochs']} epochs in {train['train_seconds']:.0f} s "
      f"({train['images_per_s']:.0f} images/s), {train['train_images']} images")
if evaluation:
    print(f"- evaluate: {evaluation['variant']} served accuracy {evaluation['accuracy']:.4f} on {evaluation['images']} "
          f"original files (the trained model: {evaluation.get('trained_accuracy')})")
    print(f"- benchmark (CPU rows): see project/reports/benchmark/table.md\n")
else:
    print(f"- after training: validation accuracy {train.get('val_accuracy')} (validation {train.get('validation')}), "
          f"train loss {train['train_loss']:.3f}; stages run: {sys.argv[5]}\n")
print((out / "gpu.md").read_text())
EOF
[ -f "$work/reports/benchmark/table.md" ] && cp "$work/reports/benchmark/table.md" "$out/benchmark-table.md"
step "done: $out/summary.md"
cat "$out/summary.md"
