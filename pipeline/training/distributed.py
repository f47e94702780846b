"""Devices, bf16 autocast and processes: one place for what differs between 1 CPU process, N gloo processes,
torchrun and CUDA (nccl)."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline.errors import StageError
from pipeline.machine import usable_cpus
from pipeline.machine.ports import free_port

__all__ = ["Dist", "free_port"]


@dataclass(frozen=True)
class Dist:
    """This process's place: rank of `world`, on `device`."""

    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


SINGLE = Dist(0, 1, torch.device("cpu"))


def choose_device(wanted: str) -> torch.device:
    if wanted == "cuda" and not torch.cuda.is_available():
        raise StageError("train.device is cuda but no CUDA device is available")
    if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def amp_dtype(amp: str, device: torch.device, cpu_flags: set[str] | None = None) -> torch.dtype | None:
    """bf16 autocast for `bf16`; for `auto`, where bf16 arithmetic in hardware makes it pay: CUDA with bf16, and x86
    CPUs with AMX (`amx_bf16`) or AVX512-BF16. AVX2 only emulates bf16 (slower than fp32) and Arm's bf16 is not
    measured yet: those stay fp32. The measured steps: docs/stages.md, train."""
    if amp == "bf16":
        return torch.bfloat16
    if amp != "auto":
        return None
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    from pipeline.machine import cpu_flags as read_cpu_flags

    flags = read_cpu_flags() if cpu_flags is None else cpu_flags
    x86_bf16 = {"amx_bf16", "avx512_bf16"} & flags
    return torch.bfloat16 if x86_bf16 and torch.backends.mkldnn.is_available() else None


def autocast(device: torch.device, dtype: torch.dtype | None) -> Any:
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def cpu_threads(threads: int, world: int) -> int:
    """Threads per process: `threads`, or the usable CPUs (a container's quota, OMP_NUM_THREADS) split between the
    processes."""
    return threads or max(1, usable_cpus() // world)


def place(rank: int, world: int, wanted_device: str, threads: int) -> Dist:
    """This process's device (one GPU per rank on CUDA) and CPU threads."""
    device = choose_device(wanted_device)
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(cpu_threads(threads, world))
    return Dist(rank, world, device)


def wrap_model(model: nn.Module, strategy: str, d: Dist) -> nn.Module:
    """DDP or FSDP2 (`fully_shard`, in place) over the process group; the model itself with one process."""
    if d.world == 1:
        return model
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [d.device.index] if d.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(d.device.type, (d.world,))
    fully_shard(model, mesh=mesh)
    return model


def init_local_group(rank: int, world: int, device: torch.device, port: int) -> None:
    dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def spawn(target: Callable[..., None], world: int, args: tuple[Any, ...]) -> None:
    """Run `target(rank, *args)` in `world` fresh processes; a failure in any becomes one StageError line."""
    import torch.multiprocessing as mp

    try:
        mp.start_processes(target, args=args, nprocs=world, start_method="spawn")
    except mp.ProcessRaisedException as exc:
        last = str(exc).strip().splitlines()[-1]
        raise StageError(f"a training process failed: {last}") from None
    except mp.ProcessExitedException as exc:
        raise StageError(f"a training process died: {exc}") from None


def torchrun_world() -> tuple[int, int] | None:
    """(rank, world) when this process was started by torchrun with more than one process."""
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def init_torchrun_group(rank: int, world: int, device: torch.device) -> None:
    """The process group under torchrun.

    With torchrun's shared store (its default), keys are prefixed with torchrun's restart count: after an elastic
    restart that store still holds the previous round's addresses, and gloo connecting to a dead worker's address
    would wait for it indefinitely (seen with a worker killed on one of two nodes). That count is each agent's own,
    though: an agent started again on a replaced machine counts from 0 while the others count on, and their
    groups never meet (pytorch/pytorch#135712). With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on the agents, every
    round hands workers a fresh address and rank 0 hosts a new, empty store: no prefix, and a replaced machine
    rejoins (tests/stages/test_train_multinode.py). Multi-node runs should set it; we say so when they do not."""
    from datetime import timedelta

    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    prefix = f"pipeline/restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/" if agent_store else "pipeline/"
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1") or 1)
    if agent_store and nodes > 1 and rank == 0:
        from pipeline.console import log

        log(
            "train: torchrun shares its rendezvous store with the workers: a machine replaced mid-run cannot "
            "rejoin; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun on every machine"
        )
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0 and not agent_store,  # torchrun's agent hosts the store; else rank 0 does
        timeout=timedelta(minutes=5),
    )
    dist.init_process_group(
        backend_for(device),
        store=dist.PrefixStore(prefix, store),
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=10),  # a peer lost mid-step fails the step instead of hanging for 30 min
    )


def buffers_from_rank0(model: nn.Module, strategy: str, d: Dist) -> None:
    """Before a checkpoint under DDP: every rank takes rank 0's buffers (BatchNorm running statistics). DDP does the
    same at the next forward anyway, so training is unchanged; but DCP writes one copy of a replicated tensor from
    whichever rank its planner picks, and a resumed run must start from rank 0's, as the uninterrupted one goes on."""
    if d.world > 1 and strategy == "ddp":
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
