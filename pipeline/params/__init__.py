"""The sections of params.yaml, one strict pydantic model each, and the names made from `name`.

    base.py      Section (strict, frozen, no unknown keys) and the field types several sections share
    training.py  data, model, train, augment, regularize, evaluate, optimize, tracking, tune
    serving.py   benchmark, serve, containerize, deploy, monitor
    names.py     the names a run carries, made from `name` (and `name` from the data)

pipeline.config assembles them into `Params`, layers params.yaml over a recipe over these defaults, and re-exports
every name: import them from there.
"""
