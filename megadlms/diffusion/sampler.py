"""The reference sampler for masked-diffusion LMs: LLaDA's `generate()`, step for step.

The sequence is prompt + gen_length mask tokens, decoded in blocks of block_length from left to
right (semi-autoregressive; block_length = gen_length is fully parallel). Each block gets
steps / num_blocks steps; its masked count is spread evenly over them (remainder to the first
steps). Each step runs one forward over the whole sequence, proposes x0 = argmax of the logits
(temperature 0) or of Gumbel-perturbed logits (the noise in float64, as LLaDA), scores each
masked position by the softmax probability of its x0 ('low_confidence', float64) or a uniform
draw ('random'), gives positions beyond the current block -inf, and commits the k best per row.
Classifier-free guidance: the unconditional input is the prompt replaced by mask tokens and
logits = un + (cfg_scale + 1) * (cond - un).

With the same model, inputs and random generator this picks the same tokens as LLaDA's code:
the random draws have LLaDA's shapes and order (Gumbel noise [B, L, V] float64, then the
'random' scores [B, L] float32). Two things are computed more cheaply without changing the
result: the LM head, softmax and selection run only on the window of positions that can be
committed (the current block, widened to the left only while masked prompt / earlier positions
remain), and the per-row top-k is one batched top-k (every row commits the same count).

Additions to LLaDA: left-padded batches of different prompt lengths (pads are never attended,
never committed, and positions start at 0 at each row's first real token), EOS stop (decoding
ends once every row holds an EOS with nothing masked before it: later blocks cannot change
those tokens, so the trimmed output is the same as decoding to the end) and an optional CUDA
graph of the fixed-shape forward (same tokens, no launch overhead).
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError

REMASKING = ("low_confidence", "random")

Prompts = Sequence[Sequence[int]] | torch.Tensor
Progress = bool | Callable[[int], None] | None


# --------------------------------------------------------------------------- argument checks


def check_sampling_args(*, gen_length: int, block_length: int, steps: int | None, temperature: float,
                        remasking: str, cfg_scale: float) -> None:
    """Raise ValueError naming the bad value and the fix; `steps=None` skips the step checks."""
    if not isinstance(gen_length, int) or gen_length <= 0:
        raise ConfigError(f"gen_length={gen_length!r} must be a positive integer (the number of tokens to generate)")
    if not isinstance(block_length, int) or block_length <= 0:
        raise ConfigError(f"block_length={block_length!r} must be a positive integer (e.g. 32, or gen_length)")
    if gen_length % block_length:
        divisors = [d for d in range(1, gen_length + 1) if gen_length % d == 0 and d <= block_length][-2:]
        multiple = math.ceil(gen_length / block_length) * block_length
        raise ConfigError(f"gen_length={gen_length} is not divisible by block_length={block_length}; use a "
                         f"block_length that divides it (e.g. {' or '.join(map(str, divisors))}) or a gen_length "
                         f"that is a multiple of {block_length} (e.g. {multiple})")
    num_blocks = gen_length // block_length
    if steps is not None:
        if not isinstance(steps, int) or steps <= 0:
            raise ConfigError(f"steps={steps!r} must be a positive integer (e.g. gen_length={gen_length})")
        if steps % num_blocks:
            lo = max(num_blocks, steps // num_blocks * num_blocks)
            raise ConfigError(f"steps={steps} cannot be spread evenly over gen_length/block_length = {num_blocks} "
                             f"blocks; use a multiple of {num_blocks} (e.g. {lo} or {lo + num_blocks})")
        if steps > gen_length:
            raise ConfigError(f"steps={steps} exceeds gen_length={gen_length}: a step commits at least one token, "
                             f"so the extra steps would only repeat forwards; use steps <= {gen_length}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ConfigError(f"temperature={temperature} must be >= 0 (0 = greedy argmax)")
    if remasking not in REMASKING:
        raise ConfigError(f"remasking={remasking!r} is not one of {list(REMASKING)}")
    if not math.isfinite(cfg_scale) or cfg_scale < 0:
        raise ConfigError(f"cfg_scale={cfg_scale} must be >= 0 (0 disables classifier-free guidance)")


def check_model_fit(model: nn.Module, *, mask_id: int, total_length: int, prompt_length: int,
                    gen_length: int) -> None:
    """The mask id must be in the vocabulary and prompt + generation within max_position_embeddings."""
    cfg = getattr(model, "config", None)
    vocab = getattr(cfg, "vocab_size", None)
    if not isinstance(mask_id, int) or isinstance(mask_id, bool):
        raise ConfigError(f"mask_id={mask_id!r} must be an int token id")
    if vocab is not None and not 0 <= mask_id < vocab:
        raise ConfigError(f"mask_id={mask_id} is outside the vocabulary [0, {vocab}); pass the mask token id "
                         "the model was trained with (--mask-token; the checkpoint config's mask_token_id)")
    max_pos = getattr(cfg, "max_position_embeddings", None)
    if max_pos is not None and total_length > max_pos:
        fix = f"lower the generation length to at most {max(max_pos - prompt_length, 0)}"
        if gen_length < max_pos:
            fix = f"shorten the prompt to at most {max_pos - gen_length} tokens or {fix}"
        raise ConfigError(f"prompt length {prompt_length} + generation length {gen_length} = {total_length} exceeds "
                         f"the model's max_position_embeddings={max_pos}; {fix}")


def model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


# --------------------------------------------------------------------------- prompts


def model_prompts(model: nn.Module, prompts: Prompts, mask_id: int | None, pad_id: int | None
                  ) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    """(mask_id, input_ids long [B, P], attention_mask bool [B, P] or None) for a diffusion sampler: the mask id
    given or the model config's, the prompts left-padded on the model's device (with pad_id, default the mask id)
    and checked against its vocabulary."""
    cfg = getattr(model, "config", None)
    if mask_id is None:
        mask_id = getattr(cfg, "mask_token_id", None)
        if mask_id is None:
            raise ConfigError("mask_id is not given and model.config.mask_token_id is None; pass mask_id= (the "
                              "[MASK] token id the model was trained with)")
    ids, attn = prepare_prompts(prompts, pad_id=mask_id if pad_id is None else pad_id, device=model_device(model),
                                vocab_size=getattr(cfg, "vocab_size", None))
    return mask_id, ids, attn


def prepare_prompts(prompts: Prompts, *, pad_id: int, device: torch.device | str,
                    vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prompts -> (input_ids long [B, P], attention_mask bool [B, P] or None when no row is padded).

    A tensor [B, P] (or [P]) is taken as it is; a list of token lists is left-padded with
    `pad_id` to the longest, so every row's generation starts at the same column.
    """
    if isinstance(prompts, torch.Tensor):
        ids = prompts[None] if prompts.dim() == 1 else prompts
        if ids.dim() != 2:
            raise ConfigError(f"prompts tensor must be [B, P] or [P], got shape {tuple(prompts.shape)}")
        ids, mask = ids.to(device=device, dtype=torch.long), None
    else:
        rows = [list(map(int, r)) for r in prompts]
        if not rows:
            raise ConfigError("prompts is empty; pass at least one prompt (a list of token ids)")
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, r in enumerate(rows):
            if r:
                ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
                mask[i, width - len(r):] = True
        ids, mask = ids.to(device), mask.to(device)
        if bool(mask.all()):
            mask = None
    if vocab_size is not None and ids.numel():
        real = ids if mask is None else ids[mask]
        if real.numel() and (int(real.min()) < 0 or int(real.max()) >= vocab_size):
            bad = real[(real < 0) | (real >= vocab_size)][:5].tolist()
            raise ConfigError(f"prompt token ids {bad} are outside the model's vocabulary [0, {vocab_size}); "
                             "encode the prompts with the model's tokenizer")
    return ids, mask


def initial_sequence(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *,
                     mask_id: int, gen_length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Check a prompt batch against the model and lay out the sequence to denoise.

    input_ids long [B, P] (left-padded), attention_mask bool [B, P] or None. Returns
    x long [B, P + gen_length] (the prompt, then mask_id) and real bool [B, P + gen_length]
    (True = a real, non-pad position), or None when no row is padded.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, P], got shape {tuple(input_ids.shape)}")
    b, p = input_ids.shape
    check_model_fit(model, mask_id=mask_id, total_length=p + gen_length, prompt_length=p, gen_length=gen_length)
    device = input_ids.device
    x = torch.full((b, p + gen_length), mask_id, dtype=torch.long, device=device)
    x[:, :p] = input_ids
    real = None
    if attention_mask is not None and not bool(attention_mask.all()):
        real = torch.cat([attention_mask.to(device=device, dtype=torch.bool),
                          torch.ones(b, gen_length, dtype=torch.bool, device=device)], dim=1)
    return x, real


def logits_shift(model: nn.Module, prompt_length: int) -> int:
    """1 for a difflm-shift model (the logits at position i predict token i + 1), else 0. Such a model needs a
    prompt: the first generated token is predicted from the last prompt position."""
    shift = int(bool(getattr(getattr(model, "config", None), "diffusion_shift", False)))
    if shift and prompt_length < 1:
        raise ConfigError("a difflm-shift model predicts each token from the position before it: give a prompt of "
                          "at least one token")
    return shift


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """bool [B, T] (True = real) -> long [B, T]: 0 at each row's first real token (pads get 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def trim_at_eos(tokens: torch.Tensor, eos_id: int | None) -> list[list[int]]:
    """long [B, G] -> per row the tokens before the first `eos_id` (all of them when eos_id is None)."""
    out = []
    for row in tokens.tolist():
        if eos_id is not None and eos_id in row:
            row = row[:row.index(eos_id)]
        out.append(row)
    return out


def eos_reached(gen: torch.Tensor, *, eos_id: int, mask_id: int) -> bool:
    """gen long [B, G]: True when every row holds an EOS with no mask token before it."""
    is_eos = gen == eos_id
    cols = torch.arange(gen.shape[1], device=gen.device)
    first = torch.where(is_eos.any(1), is_eos.long().argmax(1), gen.shape[1])
    masked_before = ((gen == mask_id) & (cols[None] < first[:, None])).any(1)
    return bool((is_eos.any(1) & ~masked_before).all())


# --------------------------------------------------------------------------- LLaDA's pieces


def get_num_transfer_tokens(mask_index: torch.Tensor, steps: int) -> torch.Tensor:
    """bool [B, L] masked positions of a block -> long [B, steps] tokens to commit per step.

    The masked count is spread evenly; the remainder goes one each to the first steps (LLaDA).
    """
    mask_num = mask_index.sum(dim=1, keepdim=True)
    base, remainder = mask_num // steps, mask_num % steps
    return base + (torch.arange(steps, device=mask_index.device)[None] < remainder).long()


def gumbel_scores(logits: torch.Tensor, temperature: float, noise: torch.Tensor) -> torch.Tensor:
    """LLaDA's add_gumbel_noise in float64: exp(logits) / (-log u)^temperature; argmax samples softmax(l/T)."""
    return logits.to(torch.float64).exp() / (-torch.log(noise)) ** temperature


def nucleus_logits(logits: torch.Tensor, top_p: float, forbid: int | None = None) -> torch.Tensor:
    """logits [..., V] -> fp32 logits with every token outside the nucleus at -inf: the smallest set of most likely
    tokens whose probability mass reaches top_p (BD3-LM's nucleus sampling), after `forbid` is removed from the
    distribution. top_p >= 1 keeps every token."""
    lf = logits.float()
    if forbid is not None:
        lf = lf.clone()
        lf[..., forbid] = -math.inf
    if top_p >= 1.0:
        return lf
    sorted_l, order = lf.sort(dim=-1, descending=True)
    p = F.softmax(sorted_l, dim=-1)
    drop = p.cumsum(dim=-1) - p > top_p  # the mass before a token already reaches top_p
    return torch.empty_like(lf).scatter_(-1, order, sorted_l.masked_fill(drop, -math.inf))


def propose(logits: torch.Tensor, *, temperature: float, remasking: str, noise: torch.Tensor | None = None,
            random_scores: torch.Tensor | None = None, forbid: int | None = None,
            top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, W, V] -> (x0 long [B, W], score [B, W]).

    x0 is the argmax of the logits (temperature 0) or of the Gumbel scores (`noise` float64
    [B, W, V] uniform): a draw from softmax(logits / T), restricted to the top_p nucleus when top_p < 1. score is
    the float64 softmax probability of x0 ('low_confidence') or `random_scores` ('random'). `forbid`: a token id
    x0 may not take (the fast sampler never commits the mask token); the score still uses the full softmax.
    """
    if temperature > 0:
        if noise is None:
            raise ValueError("propose: temperature > 0 needs the uniform noise tensor")
        drawn = logits if top_p >= 1.0 else nucleus_logits(logits, top_p, forbid)
        scores = gumbel_scores(drawn, temperature, noise)
    else:
        scores = logits
    if forbid is not None:
        scores = scores.clone()
        scores[..., forbid] = -math.inf
    x0 = scores.argmax(dim=-1)
    if remasking == "low_confidence":
        p = F.softmax(logits.to(torch.float64), dim=-1)
        score = torch.gather(p, -1, x0[..., None]).squeeze(-1)
    elif remasking == "random":
        if random_scores is None:
            raise ValueError("propose: remasking='random' needs random_scores")
        score = random_scores
    else:
        raise ValueError(f"remasking={remasking!r} is not one of {list(REMASKING)}")
    return x0, score


def guided_logits(logits: torch.Tensor, cfg_scale: float) -> torch.Tensor:
    """[2B, W, V] (conditional rows first) -> [B, W, V] = un + (s + 1) * (cond - un)."""
    cond, un = logits.chunk(2, dim=0)
    return un + (cfg_scale + 1) * (cond - un)


# --------------------------------------------------------------------------- fixed-shape forward


class StaticGraph:
    """`fn(*inputs) -> Tensor` on fixed input buffers, replayed from a CUDA graph on CUDA.

    On CUDA, `fn` runs `warmup` times on a side stream and is then captured into a
    torch.cuda.CUDAGraph; a call copies its inputs into the buffers and replays the graph, and
    returns the graph's output buffer (valid until the next call). Elsewhere (CPU) a call runs
    `fn` eagerly on the same buffers, which exercises the same data flow. If capture fails (an
    op that syncs with the host), it warns and runs eagerly.
    """

    def __init__(self, fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], *, warmup: int = 2):
        self.fn = fn
        self.inputs = [t.clone() for t in inputs]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None
        device = self.inputs[0].device
        if device.type != "cuda":
            return
        try:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    fn(*self.inputs)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.output = fn(*self.inputs)
            self.graph = graph
        except RuntimeError as e:  # e.g. a host sync inside the forward
            warnings.warn(f"CUDA graph capture failed ({e}); running the forward eagerly", stacklevel=2)
            self.graph, self.output = None, None

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        for buf, t in zip(self.inputs, inputs, strict=True):
            if t is not buf:
                buf.copy_(t)
        if self.graph is None:
            return self.fn(*self.inputs)
        self.graph.replay()
        assert self.output is not None
        return self.output


# Graphs kept between sampler calls, per model: a capture costs far more than a step (warm-up runs, a host
# sync, a garbage collection), so repeated calls with the same shapes (batches of a prompt file, benchmarks)
# replay the graphs of the first. Bounded: each graph holds its own memory pool.
_GRAPHS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, Any]] = weakref.WeakKeyDictionary()
_GRAPHS_PER_MODEL = 8


def reused_graphs(model: nn.Module, key: tuple, build: Callable[[], Any]) -> Any:
    """What `build()` made for `model` and `key` on an earlier call, else a new one (kept for later calls).

    The key is extended with the storage of the model's parameters and buffers and the autocast state, which
    a graph has baked in: replaced weights or another precision never meet an old graph."""
    dev = next(model.parameters()).device.type
    storage = tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))
    full_key = (key, storage, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
    per_model = _GRAPHS.setdefault(model, {})
    found = per_model.get(full_key)
    if found is None:
        if len(per_model) >= _GRAPHS_PER_MODEL:
            per_model.pop(next(iter(per_model)))  # the oldest
        found = per_model[full_key] = build()
    return found


def release_graphs(model: nn.Module) -> None:
    """Drop the CUDA graphs kept for `model` (and the memory they hold)."""
    _GRAPHS.pop(model, None)


class ProgressBar:
    """progress=True: a tqdm bar; a callable: called with the increment; None/False: nothing."""

    def __init__(self, progress: Progress, total: int, unit: str):
        self.bar = None
        self.fn = progress if callable(progress) else None
        if progress is True:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit=unit, dynamic_ncols=True, leave=False)

    @property
    def active(self) -> bool:
        return self.bar is not None or self.fn is not None

    def update(self, n: int) -> None:
        if n <= 0:
            return
        if self.bar is not None:
            self.bar.update(n)
        if self.fn is not None:
            self.fn(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------- the sampler


@torch.no_grad()
def generate_tokens(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                    mask_id: int, gen_length: int = 128, block_length: int | None = None, steps: int | None = None,
                    temperature: float = 0.0, remasking: str = "low_confidence", cfg_scale: float = 0.0,
                    eos_id: int | None = None, generator: torch.Generator | None = None,
                    progress: Progress = None, cuda_graph: bool = False, exact_noise: bool = True) -> torch.Tensor:
    """LLaDA's sampler on a batch. Returns long [B, P + gen_length]: the prompt then the generation.

    input_ids: long [B, P], left-padded when prompts differ in length; attention_mask: bool [B, P]
    (True = real token) or None (no padding). block_length / steps default to gen_length.
    eos_id: stop once every row holds an EOS with nothing masked before it (positions never
    decoded then still hold mask_id, all after that EOS). generator: the source of the Gumbel
    noise and 'random' scores (the global RNG when None, as LLaDA). progress: True for a tqdm bar
    over steps, or a callable taking the step increment. cuda_graph: capture the forward in a
    CUDA graph (shapes are fixed for the call; same tokens). exact_noise=False draws the Gumbel
    noise for the committable window only instead of LLaDA's full [B, L, V] float64 tensor (less
    memory at long lengths; a different random stream).
    """
    block_length = gen_length if block_length is None else block_length
    steps = gen_length if steps is None else steps
    check_sampling_args(gen_length=gen_length, block_length=block_length, steps=steps, temperature=temperature,
                        remasking=remasking, cfg_scale=cfg_scale)
    x, real = initial_sequence(model, input_ids, attention_mask, mask_id=mask_id, gen_length=gen_length)
    b, p = input_ids.shape
    shift = logits_shift(model, p)  # difflm-shift: the logits of position i come from position i - 1
    total = p + gen_length
    device = input_ids.device
    rows = 2 * b if cfg_scale > 0 else b
    mask_in = None if real is None else real.repeat(rows // b, 1)
    pos_in = None if mask_in is None else position_ids_from_mask(mask_in)
    extra = [] if mask_in is None or pos_in is None else [mask_in, pos_in]  # graph inputs beside the tokens

    def forward(ids: torch.Tensor, mask: torch.Tensor | None = None, pos: torch.Tensor | None = None
                ) -> torch.Tensor:  # [rows, L] -> hidden [rows, L, H]
        return model(ids, attention_mask=mask, position_ids=pos, output_hidden=True)

    def model_input() -> torch.Tensor:
        if cfg_scale <= 0:
            return x
        un_x = x.clone()
        un_x[:, :p] = mask_id  # LLaDA: the prompt (x != mask at the start) replaced by mask
        return torch.cat([x, un_x], dim=0)

    if cuda_graph:
        graph = reused_graphs(model, ("reference", rows, total, mask_in is not None),
                              lambda: StaticGraph(forward, [model_input(), *extra]))

        def run(ids: torch.Tensor) -> torch.Tensor:
            return graph(ids, *extra)
    else:
        def run(ids: torch.Tensor) -> torch.Tensor:
            return forward(ids, *extra)
    num_blocks = gen_length // block_length
    steps_per_block = steps // num_blocks
    # every block is fully masked when it starts, so all rows share LLaDA's schedule
    schedule = get_num_transfer_tokens(torch.ones(1, block_length, dtype=torch.bool), steps_per_block)[0].tolist()
    bar = ProgressBar(progress, steps_per_block * num_blocks, "step")
    try:
        for blk in range(num_blocks):
            start, end = p + blk * block_length, p + (blk + 1) * block_length
            # LLaDA lets any masked position left of the block end be committed: widen the window to
            # the first one (masked prompt tokens, or earlier positions whose x0 was the mask token)
            left = (x[:, :start] == mask_id) if real is None else (x[:, :start] == mask_id) & real[:, :start]
            cols = left.any(0).nonzero()
            w0 = max(int(cols[0]) if cols.numel() else start, shift)
            for i in range(steps_per_block):
                hidden = run(model_input())
                logits = model.logits(hidden[:, w0 - shift:end - shift])  # type: ignore[operator]
                if cfg_scale > 0:
                    logits = guided_logits(logits, cfg_scale)
                noise = rand = None
                if temperature > 0:  # LLaDA's rand_like over the full [B, L, V] logits
                    shape = (b, total if exact_noise else end - w0, logits.shape[-1])
                    noise = torch.rand(shape, dtype=torch.float64, device=device, generator=generator)
                    noise = noise[:, w0:end] if exact_noise else noise
                if remasking == "random":
                    rand = torch.rand((b, total), device=device, generator=generator)[:, w0:end]
                x0, score = propose(logits, temperature=temperature, remasking=remasking, noise=noise,
                                    random_scores=rand)
                window = x[:, w0:end]
                masked = window == mask_id
                if real is not None:
                    masked &= real[:, w0:end]
                confidence = torch.where(masked, score, -math.inf)
                x0 = torch.where(masked, x0, window)  # as LLaDA: a non-masked pick rewrites its own token
                idx = confidence.topk(schedule[i], dim=-1).indices
                window.scatter_(1, idx, x0.gather(1, idx))
                bar.update(1)
            if eos_id is not None and blk + 1 < num_blocks and eos_reached(x[:, p:end], eos_id=eos_id,
                                                                          mask_id=mask_id):
                break
    finally:
        bar.close()
    return x


def generate(model: nn.Module, prompts: Prompts, *, mask_id: int | None = None, gen_length: int = 128,
             block_length: int | None = None, steps: int | None = None, temperature: float = 0.0,
             remasking: str = "low_confidence", cfg_scale: float = 0.0, eos_id: int | None = None,
             pad_id: int | None = None, generator: torch.Generator | None = None, progress: Progress = None,
             cuda_graph: bool = False) -> list[list[int]]:
    """Generate from a masked-diffusion model with LLaDA's sampler; returns the new tokens per prompt.

    prompts: token-id lists (any lengths; left-padded internally) or a long tensor [B, P].
    mask_id defaults to model.config.mask_token_id. block_length and steps default to
    gen_length (one token per step, fully parallel). With eos_id, each output is cut before its
    first EOS and decoding stops early once every row has one. See `generate_tokens`.
    """
    if mask_id is None:
        mask_id = getattr(getattr(model, "config", None), "mask_token_id", None)
        if mask_id is None:
            raise ConfigError("mask_id is not given and model.config.mask_token_id is None; pass mask_id= (the "
                             "[MASK] token id the model was trained with)")
    device = model_device(model)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    ids, attn = prepare_prompts(prompts, pad_id=mask_id if pad_id is None else pad_id, device=device,
                                vocab_size=vocab)
    out = generate_tokens(model, ids, attn, mask_id=mask_id, gen_length=gen_length, block_length=block_length,
                          steps=steps, temperature=temperature, remasking=remasking, cfg_scale=cfg_scale,
                          eos_id=eos_id, generator=generator, progress=progress, cuda_graph=cuda_graph)
    return trim_at_eos(out[:, ids.shape[1]:], eos_id)
