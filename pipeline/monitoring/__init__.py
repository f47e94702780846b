"""Watching a served model: the drift signals the server counts (drift), `pipeline monitor`'s probe of a running
server (probe) and its drift check against the served variant's reference (drift_check)."""
