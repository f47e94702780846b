"""The inference server: main.py (`pipeline serve`: load the chosen variant, run uvicorn), app.py (the ASGI app:
OIP v2 + /v1/predict, assembled by create_app), inference.py (the one inference path), hotpath.py (the inference
routes' short path), the request rules (auth.py: the bearer token; guard.py: body size and deadline; refusal.py: the
one JSON form of every refusal; access.py: request ids and the access log), metrics.py (Prometheus), batcher.py
(dynamic batching), protocol.py (request decoding: also what evaluate uses to measure served accuracy), model.py (the
served variant through pipeline.runtimes)."""
