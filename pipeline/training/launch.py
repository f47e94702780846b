"""The processes of a run on several: the workers `train.nproc` spawns here, and the checks a torchrun job makes
before any step (every rank the same run, one checkpoint folder all of them see)."""

from __future__ import annotations

import json
import secrets
import socket
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pipeline.config import Params
from pipeline.errors import StageError
from pipeline.tracking import metrics_logger
from pipeline.training import checkpoint as ckpt
from pipeline.training import distributed
from pipeline.training.loop import no_log, worker


def spawned(
    rank: int,
    world: int,
    params_json: str,
    resume: ckpt.Resume | None,
    run_id: str | None,
    port: int,
    result_path: str,
) -> None:
    """One of `train.nproc` processes (distributed.spawn's target): rank 0 logs to the MLflow run `run_id` and
    writes the summary to `result_path`."""
    params = Params.model_validate_json(params_json)
    distributed.init_local_group(rank, world, distributed.choose_device(params.train.device), port)
    try:
        log = metrics_logger(params.tracking, run_id) if rank == 0 else no_log
        summary = worker(rank, world, params, resume, log)
        if rank == 0:
            Path(result_path).write_text(json.dumps(summary))
    finally:
        dist.destroy_process_group()


def check_same_run_everywhere(folder: Path, rank: int, world: int) -> None:
    """With torchrun on several machines, every rank must train the same params and data and see the same
    checkpoint folder (rank 0 seals what all ranks write): else one line on every rank, before any step."""
    token = [secrets.token_hex(8) if rank == 0 else ""]
    dist.broadcast_object_list(token, src=0)
    probe = folder.parent / f".shared-{token[0]}"
    if rank == 0:
        folder.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
    dist.barrier()
    seen: list[Any] = [None] * world
    dist.all_gather_object(seen, (folder.name, probe.exists(), socket.gethostname()))
    dist.barrier()
    if rank == 0:
        probe.unlink(missing_ok=True)
    differ = [r for r, (name, _, _) in enumerate(seen) if name != seen[0][0]]
    if differ:
        raise StageError(
            f"ranks {differ} ({', '.join(seen[r][2] for r in differ)}) have other params or prepared data than rank 0 "
            "(their checkpoint fingerprint differs): run every node from the same commit, params and `dvc pull`ed data"
        )
    blind = [r for r, (_, saw, _) in enumerate(seen) if not saw]
    if blind:
        raise StageError(
            f"train.checkpoint_dir {folder.parent} is not shared: ranks {blind} ({', '.join(seen[r][2] for r in blind)}) "
            "do not see what rank 0 writes there; on several machines set it to a folder every node mounts "
            "(NFS, a ReadWriteMany volume)"
        )
