"""Two torchrun agents (--nnodes 2, c10d rendezvous on 127.0.0.1), each in its own working copy as on two
machines, train one job: checkpoints in a folder both see, sealed by rank 0; a worker killed with SIGKILL
mid-run is restarted by torchrun (--max-restarts) on both nodes from the last complete checkpoint, and the
result is bit-identical to an uninterrupted two-node run; a checkpoint folder that is not shared is refused
on every rank before any step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.ports import free_port
from pipeline.stages import train
from tests.helpers import REPO
from tests.helpers.params import train_params, write_params_yaml
from tests.helpers.prepared import write_prepared

pytestmark = pytest.mark.slow


def _two_nodes(root: Path, checkpoint_dir: str | None, kill_on_node_1: int = 0, restarts: int = 1) -> list[Path]:
    """Run the two agents to the end; returns both working copies."""
    port = free_port()
    copies, agents = [], []
    for node in (0, 1):
        work = root / f"node{node}"
        work.mkdir(parents=True)
        write_prepared(work)  # each machine prepares (or `dvc pull`s) the same data
        params = train_params(checkpoint_dir=checkpoint_dir or "models/checkpoints")
        write_params_yaml(work / "params.yaml", params)
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        env.pop("MLFLOW_TRACKING_URI", None)
        env.pop(train.KILL_AFTER_STEP_ENV, None)
        if node == 1 and kill_on_node_1:
            env[train.KILL_AFTER_STEP_ENV] = str(kill_on_node_1)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job",
               "--max-restarts", str(restarts), "--monitor-interval", "0.5",
               "-m", "pipeline.cli", "train", "-p", "params.yaml"]  # fmt: skip
        log = (root / f"node{node}.log").open("w")
        agents.append(subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT))
        copies.append(work)
    for agent in agents:
        agent.wait(timeout=600)
    root.joinpath("codes").write_text(" ".join(str(a.returncode) for a in agents))
    return copies


def _logs(root: Path) -> str:
    return "\n".join((root / f"node{n}.log").read_text()[-3000:] for n in (0, 1))


def _trained(copies: list[Path]) -> dict[str, torch.Tensor]:
    """The model rank 0 wrote (c10d decides which node is rank 0)."""
    (path,) = [c / "models/model.pt" for c in copies if (c / "models/model.pt").exists()]
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def test_two_nodes_survive_a_killed_worker_and_match_an_uninterrupted_run(tmp_path: Path) -> None:
    shared = tmp_path / "shared-a"
    copies = _two_nodes(tmp_path / "a", str(shared))
    assert (tmp_path / "a/codes").read_text() == "0 0", _logs(tmp_path / "a")
    uninterrupted = _trained(copies)
    (run_folder,) = list(shared.iterdir())
    assert (run_folder / "step_00000016" / "trainer.json").exists()  # sealed once, where both nodes write

    shared = tmp_path / "shared-b"
    copies = _two_nodes(tmp_path / "b", str(shared), kill_on_node_1=5)
    logs = _logs(tmp_path / "b")
    assert (tmp_path / "b/codes").read_text() == "0 0", logs
    assert "Signals.SIGKILL" in logs or "SIGKILL" in logs, logs  # the agent saw its worker die, and restarted
    resumed = _trained(copies)
    assert resumed.keys() == uninterrupted.keys()
    for key in resumed:
        assert torch.equal(resumed[key], uninterrupted[key]), key


def test_a_checkpoint_folder_that_is_not_shared_is_refused_on_every_rank(tmp_path: Path) -> None:
    _two_nodes(tmp_path, None, restarts=0)  # relative: each machine its own models/checkpoints
    logs = _logs(tmp_path)
    assert (tmp_path / "codes").read_text() != "0 0"
    assert "train.checkpoint_dir" in logs and "is not shared" in logs, logs
    assert not any((tmp_path / f"node{n}/models/model.pt").exists() for n in (0, 1))
