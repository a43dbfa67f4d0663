"""Process-group and device-mesh setup from torchrun's environment (world size 1 without it)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    tp_size: int = 1
    mesh: DeviceMesh | None = None  # dims ("dp", "tp") when distributed

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tp_size

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank() if self.mesh is not None else 0

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.mesh["dp"].get_group() if self.mesh is not None else None

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        return self.mesh["tp"].get_group() if self.mesh is not None else None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def pick_device(requested: str | None, local_rank: int = 0) -> torch.device:
    if requested in (None, "cuda") and torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    if requested == "cuda":
        raise RuntimeError("--device cuda was requested but no CUDA GPU is visible")
    return torch.device(requested or "cpu")


def init_parallel(device: str | None = None, tp_size: int = 1, backend: str | None = None) -> ParallelContext:
    """Initialise torch.distributed when launched by torchrun (NCCL on GPUs, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local_rank)
    if world == 1 and not dist.is_initialized():
        if tp_size != 1:
            raise ValueError(f"--tensor-model-parallel-size {tp_size} needs that many processes (use torchrun)")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        return ParallelContext(device=dev)
    if world % tp_size:
        raise ValueError(f"world size {world} is not divisible by --tensor-model-parallel-size {tp_size}")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if dev.type == "cuda" else "gloo"))
    mesh = init_device_mesh(dev.type, (world // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
    return ParallelContext(rank=dist.get_rank(), world_size=world, local_rank=local_rank, device=dev,
                           tp_size=tp_size, mesh=mesh)
