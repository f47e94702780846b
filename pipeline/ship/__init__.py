"""Shipping the server: build context and image (containerize), running and smoke-testing it (deploy).

Talks to Docker through its CLI only (no Python SDK), so that the containerize and deploy stages need
nothing beyond what the project already installs. Nothing here imports torch.
"""
