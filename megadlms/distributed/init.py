"""Process-group and device-mesh setup from torchrun's environment (world size 1 without it).

`torchrun --nproc_per_node=N [--nnodes M --rdzv-endpoint HOST:PORT] pretrain_difflm.py ...` sets
RANK / WORLD_SIZE / LOCAL_RANK; `init_parallel` turns them into a process group (NCCL on GPUs,
gloo on CPU) and one ("pp", "dp", "cp", "tp") DeviceMesh (`build_mesh`); with expert parallelism also an
("edp", "ep") mesh of the same ranks for the experts. A world of
one process (plain `python`, or torchrun with one process) creates no process group at all, so the
single-device path has no overhead.
"""

from __future__ import annotations

import datetime
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..config import ConfigError


@dataclass
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    tp_size: int = 1
    cp_size: int = 1  # context parallelism: ranks sharing each sequence's positions
    pp_size: int = 1  # pipeline parallelism: consecutive stages of the layers
    mesh: DeviceMesh | None = None  # dims ("pp", "dp", "cp", "tp") when distributed (`build_mesh`)
    ep_size: int = 1  # expert parallelism: ranks sharing each MoE block's experts (within the data-parallel ranks)
    # with ep_size > 1: dims ("edp", "ep") of sizes (world / ep, ep): "ep" holds one copy of the experts, "edp" the
    # ranks that hold the same experts
    expert_mesh: DeviceMesh | None = None
    # the ranks that reduce gradients and losses: "dp", or "dp" x "cp" flattened with context parallelism
    dp_cp_mesh: DeviceMesh | None = None
    # pipeline parallelism: the ranks holding the same stages (dp x cp x tp flattened), which reduce FP8 amaxes
    stage_mesh: DeviceMesh | None = None
    # set by `parallelize_model`: how the data-parallel ranks share the model ("none" with one dp rank,
    # else one of the --data-parallel-sharding-strategy values) and whether activations are sequence-sharded
    dp_strategy: str = "none"
    sequence_parallel: bool = False

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp_size * self.cp_size * self.pp_size)

    @property
    def pp_rank(self) -> int:
        return self.mesh["pp"].get_local_rank() if self.mesh is not None and self.pp_size > 1 else 0

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        return self.mesh["pp"].get_group() if self.mesh is not None and self.pp_size > 1 else None

    @property
    def stage_group(self) -> dist.ProcessGroup | None:
        return self.stage_mesh.get_group() if self.stage_mesh is not None else None

    @property
    def dp_cp_size(self) -> int:
        """The ranks whose gradients are averaged: data parallel x context parallel."""
        return self.dp_size * self.cp_size

    @property
    def cp_rank(self) -> int:
        return self.mesh["cp"].get_local_rank() if self.mesh is not None and self.cp_size > 1 else 0

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        return self.mesh["cp"].get_group() if self.mesh is not None and self.cp_size > 1 else None

    @property
    def dp_cp_group(self) -> dist.ProcessGroup | None:
        return self.dp_cp_mesh.get_group() if self.dp_cp_mesh is not None else None

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank() if self.mesh is not None else 0

    @property
    def tp_rank(self) -> int:
        return self.mesh["tp"].get_local_rank() if self.mesh is not None else 0

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
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are visible; "
                               "launch at most that many processes per node (torchrun --nproc_per_node)")
        return torch.device("cuda", local_rank)
    if requested == "cuda":
        raise ConfigError("--device cuda was requested but no CUDA GPU is visible")
    if requested not in (None, "cpu") and not str(requested).startswith("cuda"):
        raise ConfigError(f"--device {requested!r} is not supported; use cuda or cpu")
    return torch.device(requested or "cpu")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer (it is set by torchrun)") from None


def init_parallel(device: str | None = None, tp_size: int = 1, backend: str | None = None,
                  timeout_minutes: float = 30.0, cp_size: int = 1, pp_size: int = 1,
                  ep_size: int = 1) -> ParallelContext:
    """Initialise torch.distributed when launched by torchrun (NCCL on GPUs, gloo on CPU).

    Returns the ParallelContext of this process; its mesh is `build_mesh`'s: dims ("pp", "dp", "cp", "tp"), tp
    innermost so that a TP group stays within a node. With ep_size > 1 (data parallelism alone:
    `ParallelConfig` checks) also the expert mesh ("edp", "ep"), ep innermost (an EP group within a node).
    """
    world = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    if tp_size < 1:
        raise ConfigError(f"--tensor-model-parallel-size {tp_size} must be >= 1")
    if cp_size < 1:
        raise ConfigError(f"--context-parallel-size {cp_size} must be >= 1")
    if ep_size < 1:
        raise ConfigError(f"--expert-model-parallel-size {ep_size} must be >= 1")
    dev = pick_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world == 1 and not dist.is_initialized():
        if pp_size != 1:
            raise ConfigError(f"--pipeline-model-parallel-size {pp_size} needs {pp_size} processes; launch with "
                              f"torchrun --nproc_per_node={pp_size}")
        if cp_size != 1:
            raise ConfigError(f"--context-parallel-size {cp_size} needs at least {cp_size} processes; launch "
                              f"with torchrun --nproc_per_node={cp_size} (or a multiple of it)")
        if tp_size != 1:
            raise ConfigError(f"--tensor-model-parallel-size {tp_size} needs at least {tp_size} processes; launch "
                             f"with torchrun --nproc_per_node={tp_size} (or a multiple of it)")
        if ep_size != 1:
            raise ConfigError(f"--expert-model-parallel-size {ep_size} needs at least {ep_size} processes; launch "
                              f"with torchrun --nproc_per_node={ep_size} (or a multiple of it)")
        return ParallelContext(device=dev)
    if not dist.is_initialized():
        backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
        if backend == "nccl" and dev.type != "cuda":
            raise ConfigError("--distributed-backend nccl needs GPUs; use gloo with --device cpu")
        kwargs: dict[str, Any] = {"device_id": dev} if backend == "nccl" else {}  # eager NCCL init, bound to this GPU
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes), **kwargs)
    world = dist.get_world_size()
    mesh, dp_cp = build_mesh(dev.type, world, pp_size=pp_size, cp_size=cp_size, tp_size=tp_size)
    stage = mesh["dp", "cp", "tp"]._flatten("dp_cp_tp") if pp_size > 1 else None
    if world % ep_size:
        raise ConfigError(f"world size {world} is not divisible by --expert-model-parallel-size {ep_size}; launch a "
                          f"multiple of {ep_size} processes")
    experts = (init_device_mesh(dev.type, (world // ep_size, ep_size), mesh_dim_names=("edp", "ep"))
               if ep_size > 1 else None)
    return ParallelContext(rank=dist.get_rank(), world_size=world, local_rank=local_rank, device=dev,
                           tp_size=tp_size, cp_size=cp_size, pp_size=pp_size, ep_size=ep_size, mesh=mesh,
                           dp_cp_mesh=dp_cp, stage_mesh=stage, expert_mesh=experts)


MESH_DIMS = ("pp", "dp", "cp", "tp")


def build_mesh(device_type: str, world: int, *, pp_size: int = 1, cp_size: int = 1,
               tp_size: int = 1) -> tuple[DeviceMesh, DeviceMesh]:
    """The run's one device mesh, dims ("pp", "dp", "cp", "tp") outermost first, of sizes (pp, world / (pp x cp x
    tp), cp, tp): a TP group holds neighbouring ranks (one node), a pipeline's stages the farthest apart. Returns it
    and the mesh of the ranks that average gradients and losses: "dp", or "dp" x "cp" flattened to "dp_cp" with
    context parallelism. Raises ConfigError (one line) where the world does not split so. Size-1 dims are kept, so
    every dim can be named whatever the sizes."""
    model = pp_size * cp_size * tp_size
    if world % model:
        sizes = " x ".join(f"{flag} {n}" for flag, n in (("--pipeline-model-parallel-size", pp_size),
                                                           ("--context-parallel-size", cp_size),
                                                           ("--tensor-model-parallel-size", tp_size)) if n > 1)
        raise ConfigError(f"world size {world} is not divisible by {sizes} = {model}; launch a multiple of {model} "
                          "processes")
    mesh = init_device_mesh(device_type, (pp_size, world // model, cp_size, tp_size), mesh_dim_names=MESH_DIMS)
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp") if cp_size > 1 else mesh["dp"]
    return mesh, dp_cp


def destroy_parallel() -> None:
    """Tear down the process group (if any) at the end of a run, after the last collective."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def abort_parallel(timeout_s: float = 10.0) -> None:
    """Tear down the process group (if any) after a failure: no barrier, which the other ranks may never reach.
    NCCL's communicators are aborted (this rank's queued collectives end instead of waiting for peers); gloo's
    connections close, so a peer waiting on this rank in a collective fails at once instead of at the timeout.
    Returns after `timeout_s` at most, in case the teardown itself blocks."""
    if not (dist.is_available() and dist.is_initialized()):
        return

    def teardown() -> None:
        try:
            if dist.get_backend() == "nccl" and hasattr(dist.distributed_c10d, "_abort_process_group"):
                dist.distributed_c10d._abort_process_group()
            else:
                dist.destroy_process_group()
        except Exception:  # already broken by the failure: nothing more to release
            pass

    worker = threading.Thread(target=teardown, name="megadlms-abort-parallel", daemon=True)
    worker.start()
    worker.join(timeout_s)
