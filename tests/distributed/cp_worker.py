"""Launched by test_context_parallel.py under torchrun: the objectives' losses and gradients under context
parallelism against the same model on whole sequences.

For each case the reference (one copy of the model, `Sharding` without cp) and the context-parallel model (a deep
copy wrapped by `apply_context_parallel`) compute one micro-batch's loss and gradients from the same samples and
noise; the cp ranks' losses and gradients are averaged over the cp group (as the trainer's reduction over data x
context-parallel ranks does). Rank 0 writes, per case, the relative differences to the JSON file argv[1].
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
from megadlms.distributed.context_parallel import apply_context_parallel
from megadlms.distributed.init import destroy_parallel
from megadlms.training.documents import AttentionPlan
from megadlms.training.objectives import Sharding, build_objective

SEQ, VOCAB, MASK, EOD = 16, 96, 95, 7
CASES = {
    # name: (running mode, sft, length cut (None: whole window), document masks, loss chunk tokens)
    "masked_diffusion": ("difflm-noshift", False, None, False, 0),
    "masked_diffusion_cut_padded": ("difflm-noshift", False, 11, False, 0),
    "masked_diffusion_chunked_loss": ("difflm-noshift", False, None, False, 8),
    "shifted_diffusion_documents": ("difflm-shift", False, None, True, 0),
    "autoregressive": ("vanilla", False, None, False, 0),
    "autoregressive_cut_padded": ("vanilla", False, 9, False, 0),
    "autoregressive_documents": ("vanilla", False, None, True, 0),
    "sft_masked_diffusion": ("difflm-noshift", True, None, True, 0),
    "sft_autoregressive": ("vanilla", True, None, True, 0),
    "bd3lm": ("bd3lm", False, None, False, 0),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def samples(sft: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(8, MASK, (2, SEQ + 1), generator=g)
    tokens[0, 5], tokens[1, 11] = EOD, EOD  # documents for the EOD document masks
    if not sft:
        return tokens
    loss_mask = (torch.arange(SEQ + 1) % 6 >= 2).long().expand(2, -1)  # prompts of 2, responses of 4
    segments = (torch.arange(SEQ + 1) // 6 + 1).expand(2, -1).clone()
    segments[1, 14:] = 0  # padding at the end of the second row
    return torch.stack([tokens, loss_mask, segments], dim=1)  # [B, 3, L+1]


def loss_and_grads(model, mode, sft, cut, documents, chunk, cp_rank, cp_size):
    cfg: TransformerConfig = model.config
    causal = mode == "vanilla"
    bd3 = None
    if mode == "bd3lm":
        bd3 = bd3lm.Bd3lmConfig(block_size=4, seq_length=SEQ, mask_token_id=MASK)
    plan = AttentionPlan(reset_attention_mask=documents, reset_position_ids=documents, causal=causal, eod_id=EOD)
    sharding = Sharding(2, cp_rank=cp_rank, cp_size=cp_size)
    objective = build_objective(ObjectiveConfig(mode="difflm-noshift" if bd3 else mode, mask_token_id=MASK,
                                                varilen_prob=0.0), cfg, plan, sharding, sft=sft,
                                bd3lm_config=bd3, flex=False, loss_chunk_tokens=chunk)
    noise = objective.draw_noise(MaskSampler(3), 2, 1)
    if cut is not None:
        noise.lengths[0] = cut
    batch = next(objective.micro_batches(iter([samples(sft)]), noise, 1, torch.device("cpu")))
    for p in model.parameters():
        p.grad = None
    loss = objective.loss(model, batch, lambda: model.output_weight)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def run_case(group, mode, sft, cut, documents, chunk):
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=128, vocab_size=VOCAB, seq_length=SEQ, mask_token_id=MASK,
                            attn_mask_type="causal" if mode == "vanilla" else "bidirectional",
                            diffusion_shift=mode == "difflm-shift", block_size=4 if mode == "bd3lm" else None)
    ref = build_model(cfg)
    model = copy.deepcopy(ref)
    apply_context_parallel(model, group)
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    ref_loss, ref_grads = loss_and_grads(ref, mode, sft, cut, documents, chunk, 0, 1)
    loss, grads = loss_and_grads(model, mode, sft, cut, documents, chunk, cp_rank, cp_size)
    dist.all_reduce(loss, group=group)
    loss /= cp_size
    diffs = {}
    for n, g in grads.items():
        dist.all_reduce(g, group=group)
        diffs[n] = rel(g / cp_size, ref_grads[n])
    worst = max(diffs, key=diffs.get)
    return {"loss": rel(loss, ref_loss), "ref_loss": ref_loss.item(), "grads": diffs[worst], "worst_param": worst}


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
