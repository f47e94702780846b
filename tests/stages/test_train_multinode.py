"""Two torchrun agents (--nnodes 2, c10d rendezvous on 127.0.0.1), each in its own working copy as on two
machines, train one job: checkpoints in a folder both see, sealed by rank 0. A worker killed with SIGKILL is
restarted by torchrun (--max-restarts) on both nodes from the last complete checkpoint, and the result is
bit-identical to an uninterrupted two-node run; so is the run where a whole machine is lost (its agent and worker
SIGKILLed together) and started again. A checkpoint folder that is not shared is refused on every rank before any
step."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.machine.ports import free_port
from pipeline.training.loop import KILL_AFTER_STEP_ENV, KILL_NODE_ENV
from tests.helpers import REPO
from tests.helpers.params import train_params, write_params_yaml
from tests.helpers.prepared import write_prepared

pytestmark = pytest.mark.slow


class Job:
    """The two machines of one job: a working copy each (same data, same params), one rendezvous."""

    def __init__(
        self, root: Path, checkpoint_dir: str | None, restarts: int = 3, agent_env: dict[str, str] | None = None
    ) -> None:
        self.root, self.restarts, self.port = root, restarts, free_port()
        # torchrun's own settings, the same on every machine; by default what docs/scaling.md prescribes: a fresh
        # store per rendezvous round (with torchrun's shared store, agents that counted their restarts differently,
        # e.g. one restarted twice, key their groups apart and hang: seen once in CI).
        self.agent_env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if agent_env is None else agent_env
        self.copies: list[Path] = []
        for node in (0, 1):
            work = root / f"node{node}"
            work.mkdir(parents=True)
            write_prepared(work)  # each machine prepares (or `dvc pull`s) the same data
            write_params_yaml(work / "params.yaml", train_params(checkpoint_dir=checkpoint_dir or "models/checkpoints"))
            self.copies.append(work)
        self.agents: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, node: int, env: dict[str, str] | None = None) -> None:
        environment = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **self.agent_env, **(env or {})}
        environment.pop("MLFLOW_TRACKING_URI", None)
        if not env:
            environment.pop(KILL_AFTER_STEP_ENV, None)
            environment.pop(KILL_NODE_ENV, None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", "job",
               "--max-restarts", str(self.restarts), "--monitor-interval", "0.5",
               "-m", "pipeline.cli", "train", "-p", "params.yaml"]  # fmt: skip
        log = (self.root / f"node{node}.log").open("a")
        self.agents[node] = subprocess.Popen(
            cmd, cwd=self.copies[node], env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        if node == 0:
            time.sleep(2)  # node 0 binds the rendezvous endpoint and hosts its store, as the master node does

    def wait(self) -> list[int]:
        return [self.agents[n].wait(timeout=600) for n in (0, 1)]

    def logs(self) -> str:
        return "\n".join((self.root / f"node{n}.log").read_text()[-3000:] for n in (0, 1))

    def trained(self) -> dict[str, torch.Tensor]:
        """The model rank 0 wrote (the rendezvous decides which node is rank 0)."""
        (path,) = [c / "models/model.pt" for c in self.copies if (c / "models/model.pt").exists()]
        return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def _assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for key in got:
        assert torch.equal(got[key], expected[key]), key


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    root = tmp_path_factory.mktemp("uninterrupted")
    job = Job(root, str(root / "shared"))
    job.start(0)
    job.start(1)
    assert job.wait() == [0, 0], job.logs()
    (run_folder,) = list((root / "shared").iterdir())
    assert (run_folder / "step_00000016" / "trainer.json").exists()  # sealed once, where both nodes write
    return job.trained()


def test_a_killed_worker_is_restarted_on_both_nodes_from_the_last_checkpoint(
    uninterrupted: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    job = Job(tmp_path, str(tmp_path / "shared"))
    job.start(0)
    job.start(1, {KILL_AFTER_STEP_ENV: "5"})  # node 1's worker SIGKILLs itself after step 5
    assert job.wait() == [0, 0], job.logs()
    assert "exitcode: -9" in job.logs()  # its agent saw the worker die (SIGKILL), and both nodes restarted
    _assert_same(job.trained(), uninterrupted)


def test_a_lost_machine_started_again_rejoins_and_the_job_resumes_from_the_last_checkpoint(
    uninterrupted: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    job = Job(tmp_path, str(tmp_path / "shared"))
    job.start(0)
    job.start(1, {KILL_AFTER_STEP_ENV: "5", KILL_NODE_ENV: "1"})  # agent + worker die after step 5
    assert job.agents[1].wait(timeout=300) == -9  # the machine is gone; node 0's worker fails, its agent waits
    job.start(1)  # the machine comes back: a new agent, restart count 0, joins node 0's next round
    assert job.wait() == [0, 0], job.logs()
    assert "resumed from" in job.logs() and "step 3)" in job.logs()  # the last complete checkpoint before the loss
    _assert_same(job.trained(), uninterrupted)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" not in job.logs()


def test_a_checkpoint_folder_that_is_not_shared_is_refused_on_every_rank(tmp_path: Path) -> None:
    job = Job(tmp_path, None, restarts=0, agent_env={})  # relative: each its own models/checkpoints; shared store
    job.start(0)
    job.start(1)
    codes = job.wait()
    assert codes != [0, 0]
    assert "train.checkpoint_dir" in job.logs() and "is not shared" in job.logs(), job.logs()
    assert not any((c / "models/model.pt").exists() for c in job.copies)
    # torchrun's default shared store: rank 0 says that a replaced machine could not rejoin, and what to set.
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in job.logs()
