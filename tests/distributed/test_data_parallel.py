"""megadlms.distributed.data_parallel on one gloo process: what wrapping a model says and keeps."""

import warnings

import torch
import torch.distributed as dist
from torch import nn

from megadlms.distributed.data_parallel import apply_ddp


def test_ddp_wraps_without_warnings_and_keeps_rank_local_buffers():
    """No deprecation warning on any supported torch (2.13 deprecates broadcast_buffers), and buffers are not
    broadcast by the forward: a rank's own FP8 amax history stays its own until fp8_step reduces it."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.Linear(4, 3)
        model.register_buffer("amax", torch.tensor([2.5]))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = apply_ddp(model, dist.group.WORLD, torch.device("cpu"))
        assert [str(w.message) for w in caught] == []
        assert ddp.broadcast_buffers is False
        model.amax.fill_(7.0)
        ddp(torch.ones(2, 4)).sum().backward()
        assert model.amax.item() == 7.0 and model.weight.grad is not None
    finally:
        dist.destroy_process_group()
