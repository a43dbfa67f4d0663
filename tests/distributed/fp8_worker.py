"""Launched by test_fp8_across_ranks.py under torchrun: FP8 training runs that record every `fp8_step`.

Usage: fp8_worker.py OUT.json -- RUN_NAME FLAGS... [-- RUN_NAME FLAGS...]
Each run is a full `setup(args).run()` of the trainer (the same process group throughout). A spy around
`megadlms.fp8.fp8_step` records, per step, the amaxes of this rank before the reduction, the reduced
amaxes after it (history slot 1, so runs need --fp8-amax-history-len >= 2), the scales, the number of
all_reduce calls and the reduction group. Rank 0 writes, per run, whether the reduced amaxes equal the
max over the ranks of the group and whether the scales agree within the group and across it.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import megadlms.fp8 as fp8
import megadlms.fp8.convert as fp8_convert
from megadlms.distributed.init import destroy_parallel
from megadlms.training.args import parse_train_args
from megadlms.training.trainer import setup

RECORDS: list[dict] = []


def spy(model: torch.nn.Module, group=None) -> None:
    modules = list(fp8.fp8_modules(model))
    local = torch.stack([m.fp8_amax_history[0].clone() for m in modules])
    calls = []
    all_reduce = fp8_convert.dist.all_reduce
    fp8_convert.dist.all_reduce = lambda *a, **k: calls.append(k.get("op")) or all_reduce(*a, **k)
    try:
        ORIGINAL(model, group)
    finally:
        fp8_convert.dist.all_reduce = all_reduce
    RECORDS.append({"local": local, "reduced": torch.stack([m.fp8_amax_history[1].clone() for m in modules]),
                    "scales": torch.stack([m.fp8_scale.clone() for m in modules]), "calls": calls, "group": group})


ORIGINAL = fp8.fp8_step
fp8.fp8_step = spy  # the trainer imports fp8_step from megadlms.fp8 at each step


def gather(t: torch.Tensor, group=None) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return out


def check_run(argv: list[str]) -> dict:
    RECORDS.clear()
    trainer = setup(parse_train_args(argv))
    trainer.run()
    result = {"steps": len(RECORDS), "max_over_group": True, "scales_equal_in_group": True,
              "scales_equal_in_world": True, "one_max_all_reduce": True, "locals_differ_in_group": False}
    for r in RECORDS:
        group = r["group"]
        locals_ = gather(r["local"], group)
        expected = torch.stack(locals_).amax(dim=0)
        result["max_over_group"] &= bool(torch.equal(r["reduced"], expected))
        result["locals_differ_in_group"] |= any(not torch.equal(x, locals_[0]) for x in locals_)
        result["scales_equal_in_group"] &= all(torch.equal(s, r["scales"]) for s in gather(r["scales"], group))
        result["scales_equal_in_world"] &= all(torch.equal(s, r["scales"]) for s in gather(r["scales"]))
        result["one_max_all_reduce"] &= r["calls"] == [dist.ReduceOp.MAX]
        result["group_size"] = dist.get_world_size(group)
    return result


def main() -> None:
    out, rest = sys.argv[1], sys.argv[2:]
    runs, current = [], None
    for a in rest:
        if a == "--":
            current = []
            runs.append(current)
        else:
            current.append(a)
    results = {argv[0]: check_run(argv[1:]) for argv in runs}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    destroy_parallel()  # barrier first: no rank tears gloo down while a peer still talks to it


if __name__ == "__main__":
    main()
