"""The DVC stages, one module each with one `run(params)`: prepare, weights, train, evaluate, optimize, benchmark,
card, containerize, deploy. dvc.yaml, the CLI and the tests call the same entries. No stage imports another:
they meet only through the files of pipeline/artifacts/."""

STAGES = ("prepare", "weights", "train", "evaluate", "optimize", "benchmark", "card", "containerize", "deploy")
