"""Launched by test_pipeline_parallel.py under torchrun: a step's losses and gradients of a 2-rank pipeline
(torch.distributed.pipelining: 1F1B, GPipe, and interleaved 1F1B with 2 virtual stages per rank) against the same
model running the micro-batches one after another.

For each case the reference (the whole model; every micro-batch's loss / M backpropagated, as the trainer
accumulates) and the pipeline (a deep copy split into `PipelineStageModule`s) run the same M micro-batches of an
objective; rank 0 writes, per case, the relative differences of the losses (the last stage's) and of every
parameter gradient (each stage's own) to the JSON file argv[1].
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist

from megadlms.build import build_model
from megadlms.config import TransformerConfig
from megadlms.diffusion import bd3lm
from megadlms.diffusion.objective import MaskSampler, ObjectiveConfig
from megadlms.distributed.init import destroy_parallel
from megadlms.distributed.pipeline_parallel import (
    PipelineStageModule,
    RankStages,
    build_schedule,
    rank_stages,
    run_schedule,
    sync_tied_gradients,
)
from megadlms.training.documents import AttentionPlan
from megadlms.training.objectives import Sharding, build_objective

SEQ, VOCAB, MASK, EOD, MICRO = 16, 96, 95, 7, 4
CASES = {
    # name: (running mode, schedule, tied embeddings, document masks, virtual stages per rank)
    "masked_diffusion_1f1b": ("difflm-noshift", "1f1b", True, False, 1),
    "masked_diffusion_gpipe_untied": ("difflm-noshift", "gpipe", False, False, 1),
    "autoregressive_documents_1f1b": ("vanilla", "1f1b", True, True, 1),
    "bd3lm_1f1b": ("bd3lm", "1f1b", False, False, 1),
    "masked_diffusion_interleaved": ("difflm-noshift", "1f1b", True, False, 2),
    "autoregressive_documents_interleaved_untied": ("vanilla", "1f1b", False, True, 2),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def micro_batches(cfg: TransformerConfig, mode: str, documents: bool) -> tuple[object, list]:
    bd3 = bd3lm.Bd3lmConfig(block_size=4, seq_length=SEQ, mask_token_id=MASK) if mode == "bd3lm" else None
    plan = AttentionPlan(reset_attention_mask=documents, reset_position_ids=documents, causal=cfg.causal,
                         eod_id=EOD)
    objective = build_objective(ObjectiveConfig(mode="difflm-noshift" if bd3 else mode, mask_token_id=MASK,
                                                varilen_prob=0.0), cfg, plan, Sharding(1), sft=False,
                                bd3lm_config=bd3, flex=False, loss_chunk_tokens=0)
    g = torch.Generator().manual_seed(1)
    samples = []
    for _ in range(MICRO):
        s = torch.randint(8, MASK, (1, SEQ + 1), generator=g)
        s[0, int(torch.randint(2, SEQ - 2, (1,), generator=g))] = EOD
        samples.append(s)
    noise = objective.draw_noise(MaskSampler(3), MICRO, MICRO)
    return objective, list(objective.micro_batches(iter(samples), noise, MICRO, torch.device("cpu")))


def run_case(group, mode: str, schedule: str, tied: bool, documents: bool, virtual: int) -> dict:
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=128, vocab_size=VOCAB, seq_length=SEQ, mask_token_id=MASK,
                            attn_mask_type="causal" if mode == "vanilla" else "bidirectional",
                            untie_embeddings_and_output_weights=not tied,
                            block_size=4 if mode == "bd3lm" else None)
    ref = build_model(cfg)
    model = copy.deepcopy(ref)
    objective, batches = micro_batches(cfg, mode, documents)
    ref_losses = []
    for b in batches:
        loss = objective.loss(ref, b, lambda: ref.output_weight)
        (loss / MICRO).backward()
        ref_losses.append(loss.detach())
    pp = dist.get_world_size(group)
    stages = RankStages([PipelineStageModule(model, i, pp * virtual)
                         for i in rank_stages(dist.get_rank(group), pp, virtual)])
    last = [s for s in stages.stages if s.is_last]

    def loss_fn(hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return objective.loss_from_hidden(hidden, batches[int(index)], lambda: last[0].output_weight)

    sched = build_schedule(stages.stages, group, torch.device("cpu"), MICRO, loss_fn,
                           micro_batch=tuple(batches[0].inputs.shape), schedule=schedule)
    losses = run_schedule(sched, stages.stages, torch.cat([b.inputs for b in batches]),
                          [b.model_kwargs() for b in batches])
    sync_tied_gradients(stages.stages, group)
    ref_grads = dict(ref.named_parameters())
    diffs = {n: rel(p.grad, ref_grads[n].grad) for n, p in stages.named_parameters()}
    out = torch.tensor([max(diffs.values()), rel(torch.stack(losses), torch.stack(ref_losses)) if losses else 0.0,
                        float(len(diffs))])
    gathered = [torch.zeros(3) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, out, group=group)
    return {"grads": max(float(t[0]) for t in gathered), "loss": float(gathered[-1][1]),
            "params_per_stage": [int(t[2]) for t in gathered], "params": len(ref_grads)}


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    group = dist.group.WORLD
    results = {name: run_case(group, *case) for name, case in CASES.items()}
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    destroy_parallel()


if __name__ == "__main__":
    main()
