"""The inference server: main.py (`pipeline serve`: load the chosen variant, run uvicorn), app.py (the ASGI app:
OIP v2 + /v1/predict), batcher.py (dynamic batching), protocol.py (request decoding: also what evaluate uses to
measure served accuracy), model.py (the served variant through pipeline.runtimes)."""
