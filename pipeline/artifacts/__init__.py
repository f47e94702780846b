"""The files one stage writes and another reads: one module per file, each owning its path, its typed schema,
its writer and its reader, and one clear error (StageError) for a missing, foreign or corrupt file.

    prepared.py     data/prepared/{train,val,test}/ shards + manifest.json prepare -> train, evaluate, optimize, ...
                    (its schema, writer, storage and reader: _prepared/)
    initial_weights.py  models/weights.json (the file train starts from)  weights -> train
    model.py        models/model.pt (and the variants' .pt files)         train -> evaluate, optimize
    variants.py     models/manifest.json + models/variants/               optimize -> benchmark, containerize, serve
    serving.py      models/serving.json                                   benchmark -> serve, containerize
    predictions.py  reports/evaluate/predictions.json                     evaluate -> deploy, card
    image.py        reports/containerize/image.json                       containerize -> deploy
    benchmark_report.py  reports/benchmark/report.json                    benchmark -> card, `pipeline compare`
    evaluation.py   reports/evaluate/metrics.json                         evaluate -> card
    gate.py         reports/evaluate/gate.json                            evaluate -> serve, containerize, card
    model_card.py   reports/model_card.{md,json}                          card -> containerize (the image), serve

Nothing else in the package opens these files. Only model.py imports torch (lazily), so the server image,
which reads variants.py and serving.py, needs no training stack.
"""

from pathlib import Path

# Where the stages keep their artifacts, relative to the project root (the working directory); dvc.yaml names
# the same paths.
DATA_DIR = Path("data")
MODELS_DIR = Path("models")
REPORTS_DIR = Path("reports")
