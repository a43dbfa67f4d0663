"""The lm-evaluation-harness model class of megadlms, registered as "megadlms".

    import megadlms.eval.harness, lm_eval
    lm_eval.simple_evaluate(model="megadlms", model_args="load=runs/tiny,mc_num=32", tasks=["hellaswag"])

or `megadlms eval --load runs/tiny --tasks hellaswag` (megadlms.cli.eval). The three request types:
- loglikelihood: masked-diffusion checkpoints by LLaDA's Monte-Carlo estimator (`mc_num` draws, `cfg`,
  `greedy` = decode | argmax | off), causal (vanilla) checkpoints exactly;
- loglikelihood_rolling: documents in windows of the model's length; the deterministic ELBO over
  `elbo_ratios` mask ratios (perplexities reported are upper bounds) or, for causal models, exact;
- generate_until: the reference or fast sampler (`sampler`, `gen_length`, `block_length`, `steps`,
  `threshold`, `cache`, `cfg`, `remasking`, `temperature`), or autoregressive decoding, cut at the stop strings.
Under torchrun every rank holds the model, the harness gives each rank its share of the documents and the
results are gathered on rank 0 (`rank`, `world_size`, `all_gather`, `gather_object`, `barrier`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from ..config import ConfigError
from ..diffusion.fast_sampler import CACHE_MODES, CacheMode, fast_generate_tokens
from ..diffusion.sampler import REMASKING, check_sampling_args, generate_tokens, model_device, prepare_prompts
from ..errors import import_extra
from ..generate.ar import ar_generate_tokens
from .likelihood import (
    DEFAULT_RATIOS,
    ar_loglikelihood,
    elbo_nll,
    greedy_decodes_target,
    mc_loglikelihood,
    tokens_are_argmax,
)
from .loading import load_model

import_extra("lm_eval", "eval", "megadlms.eval.harness")  # missing: one line naming the extra, not a traceback
import lm_eval.models  # noqa: E402,F401 (its built-in names, hf ...: the registry loads them only while empty)
from lm_eval.api.model import TemplateLM  # noqa: E402 (after that check)
from lm_eval.api.registry import register_model  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

GREEDY_CHECKS = ("decode", "argmax", "off")
SAMPLERS = ("reference", "fast")


def _number(name: str, value: Any, kind: type) -> Any:
    try:
        return kind(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{name}={value!r} is not {'an integer' if kind is int else 'a number'}") from e


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        if value.lower() not in ("true", "false", "1", "0"):
            raise ConfigError(f"{value!r} is not a boolean; use true or false")
        return value.lower() in ("true", "1")
    return bool(value)


@register_model("megadlms")
class MegaDLMsLM(TemplateLM):
    """A megadlms model (checkpoint, Hugging Face folder, FP8 export, or a model object) for lm_eval.

    Keyword arguments (lm_eval's `model_args`, `k=v,k=v`):
      load / hf_model / fp8_export: the model source (or `model=` an nn.Module with `tokenizer=` its tokenizer);
      tokenizer: a tokenizer folder (default: the one stored with the model); mask_token: the [MASK] id;
      device (auto), dtype (auto | bf16 | fp32), batch_size (rows per forward), seed;
      mc_num (128), cfg (0), greedy (decode | argmax | off), elbo_ratios (10: the grid 0.1, ..., 1.0);
      sampler (reference | fast), gen_length (128), block_length (32), steps (gen_length), threshold (0.9),
      cache (dual | prefix | none), remasking (low_confidence | random), temperature (0);
      max_length: the window of rolling likelihoods (default: the model's max_position_embeddings).
    """

    def __init__(self, load: str | None = None, hf_model: str | None = None, fp8_export: str | None = None,
                 model: nn.Module | None = None, tokenizer: Any = None, iteration: int | None = None,
                 device: str = "auto", dtype: str = "auto", batch_size: int | str = 8, seed: int = 1234,
                 mask_token: int | None = None, mc_num: int = 128, cfg: float = 0.0, greedy: str = "decode",
                 elbo_ratios: int = 10, sampler: str = "reference", gen_length: int = 128, block_length: int = 32,
                 steps: int | None = None, threshold: float = 0.9, cache: str = "dual",
                 remasking: str = "low_confidence", temperature: float = 0.0, max_length: int | None = None,
                 progress: bool | str = True, max_batch_size: int | None = None):
        super().__init__()
        from ..distributed.init import init_parallel

        # the settings first: a bad one stops before a large model loads
        self.batch_size = 8 if str(batch_size).startswith("auto") else _number("batch_size", batch_size, int)
        self.seed, self.mc_num = _number("seed", seed, int), _number("mc_num", mc_num, int)
        self.cfg, self.temperature = _number("cfg", cfg, float), _number("temperature", temperature, float)
        self.greedy, self.elbo_ratios = greedy, _number("elbo_ratios", elbo_ratios, int)
        self.sampler, self.remasking = sampler, remasking
        self.gen_length, self.block_length = _number("gen_length", gen_length, int), _number(
            "block_length", block_length, int)
        self.steps = None if steps is None else _number("steps", steps, int)
        self.threshold = _number("threshold", threshold, float)
        self.cache = cast(CacheMode, None if cache in ("none", None) else cache)  # checked in _check
        self.progress = _flag(progress)
        self._check()
        ctx = init_parallel(None if device == "auto" else device)
        self._rank, self._world_size, self._device = ctx.rank, ctx.world_size, ctx.device
        if model is None:
            model, cfg_obj, tok_dir = load_model(load=load, hf_model=hf_model, fp8_export=fp8_export,
                                                 iteration=iteration, device=self._device, dtype=dtype)
        else:
            cfg_obj, tok_dir = model.config, None
            model, self._device = model.eval(), model_device(model)
        self.model, self.config = model, cfg_obj
        self.tokenizer = self._tokenizer(tokenizer if tokenizer is not None else tok_dir)
        self.tokenizer_dir = getattr(self.tokenizer, "source_dir", None)
        self.causal = cfg_obj.attn_mask_type == "causal"
        self.max_length = (_number("max_length", max_length, int) if max_length is not None
                           else cfg_obj.max_position_embeddings)
        if self.max_length < 2:
            raise ConfigError(f"max_length={self.max_length} must be >= 2")
        self.progress = self.progress and self._rank == 0
        self.mask_id = mask_token if mask_token is not None else (
            cfg_obj.mask_token_id if cfg_obj.mask_token_id is not None else getattr(self.tokenizer, "mask_id", None))
        if not self.causal:  # the sampler's own checks (gen_length, block_length, steps, ...)
            check_sampling_args(gen_length=self.gen_length, block_length=self.block_length,
                                steps=self.steps if self.sampler == "reference" else None,
                                temperature=self.temperature, remasking=self.remasking, cfg_scale=self.cfg)

    # ------------------------------------------------------------------ setup
    @staticmethod
    def _tokenizer(tok: Any) -> Any:
        if tok is None or isinstance(tok, (str, Path)):
            from ..data import load_tokenizer

            return load_tokenizer(tok)
        return tok

    def _check(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"batch_size={self.batch_size} must be >= 1")
        if self.mc_num < 1:
            raise ConfigError(f"mc_num={self.mc_num} must be a positive integer (LLaDA uses 128; 1 suffices for "
                             "single-token continuations)")
        if self.greedy not in GREEDY_CHECKS:
            raise ConfigError(f"greedy={self.greedy!r} is not one of {list(GREEDY_CHECKS)}")
        if self.elbo_ratios < 1:
            raise ConfigError(f"elbo_ratios={self.elbo_ratios} must be >= 1 (the number of mask ratios, e.g. 10)")
        if self.sampler not in SAMPLERS:
            raise ConfigError(f"sampler={self.sampler!r} is not one of {list(SAMPLERS)}")
        if self.cache not in CACHE_MODES:
            raise ConfigError(f"cache={self.cache!r} is not one of dual, prefix, none")
        if self.remasking not in REMASKING:
            raise ConfigError(f"remasking={self.remasking!r} is not one of {list(REMASKING)}")

    def _need_mask(self, what: str) -> int:
        if self.mask_id is None:
            raise ConfigError(f"{what} of a masked-diffusion model needs its [MASK] id, and neither the model "
                             "config (mask_token_id) nor the tokenizer has one; pass mask_token=ID in --model-args")
        return int(self.mask_id)

    # ------------------------------------------------------------------ lm_eval's interface
    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eod_id)

    @property
    def max_gen_toks(self) -> int:
        return self.gen_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return list(self.tokenizer.encode(string))

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer_dir or "megadlms-tokenizer").replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self._chat_template() if chat_template else None

    def _chat_template(self) -> str:
        cfg_file = Path(self.tokenizer_dir or "") / "tokenizer_config.json"
        template = json.loads(cfg_file.read_text()).get("chat_template") if cfg_file.is_file() else None
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str):
            raise ConfigError(f"--apply-chat-template: the tokenizer at {self.tokenizer_dir} has no chat_template "
                             "in tokenizer_config.json; evaluate an instruction-tuned model's folder, or drop the flag")
        return template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation rendered with the tokenizer's chat_template (tokenizer_config.json), as HF does."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ConfigError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self._chat_template()).render(
            messages=chat_history, add_generation_prompt=add_generation_prompt,
            eos_token=getattr(self.tokenizer, "eod_token", ""), bos_token="")

    def _bar(self, total: int, desc: str, disable: bool) -> tqdm:
        return tqdm(total=total, desc=desc, disable=disable or not self.progress, dynamic_ncols=True)

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        # as the harness's own models do: a context too long for the model loses its oldest tokens
        room = self.config.max_position_embeddings
        pairs = [(ctx[-max(room - len(cont), 1):], cont) for _, ctx, cont in requests]
        if not pairs:
            return []
        if self.causal:
            with self._bar(len(pairs), "loglikelihood (exact, AR)", disable_tqdm) as bar:
                return ar_loglikelihood(self.model, pairs, batch_size=self.batch_size, progress=bar.update)
        mask_id = self._need_mask("the loglikelihood")
        with self._bar(len(pairs) * self.mc_num, f"loglikelihood (MC, {self.mc_num} draws)", disable_tqdm) as bar:
            logp = mc_loglikelihood(self.model, pairs, mask_id=mask_id, mc_num=self.mc_num, seed=self.seed,
                                    cfg=self.cfg, batch_size=self.batch_size, progress=bar.update)
        greedy = self._greedy(pairs, mask_id)
        return list(zip(logp, greedy))

    def _greedy(self, pairs: list[tuple[list[int], list[int]]], mask_id: int) -> list[bool]:
        if self.greedy == "off":
            return [False] * len(pairs)
        if self.greedy == "decode":
            return greedy_decodes_target(self.model, pairs, mask_id=mask_id, cfg=self.cfg, batch_size=self.batch_size)
        return tokens_are_argmax(self.model, pairs, mask_id=mask_id, batch_size=self.batch_size)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        # an AR window's input is its tokens but the last; a diffusion window holds all of them
        span = self.max_length if self.causal else self.max_length - 1
        for n, req in enumerate(requests):
            tokens = self.tok_encode(req.args[0])
            for w in get_rolling_token_windows(tokens, self.prefix_token_id, span, context_len=1):
                windows.append(make_disjoint_window(w))
                owner.append(n)
        totals = [0.0] * len(requests)
        if not windows:
            return totals
        if self.causal:
            with self._bar(len(windows), "loglikelihood_rolling (exact, AR)", disable_tqdm) as bar:
                scores = [lp for lp, _ in ar_loglikelihood(self.model, windows, batch_size=self.batch_size,
                                                            progress=bar.update)]
        else:
            ratios = DEFAULT_RATIOS if self.elbo_ratios == 10 else [
                (i + 1) / self.elbo_ratios for i in range(self.elbo_ratios)]
            with self._bar(len(windows) * len(ratios), "loglikelihood_rolling (ELBO)", disable_tqdm) as bar:
                nll = elbo_nll(self.model, windows, mask_id=self._need_mask("the rolling likelihood"), ratios=ratios,
                               seed=self.seed, batch_size=self.batch_size, progress=bar.update)
            scores = (-nll.mean(1)).tolist()
        for n, s in zip(owner, scores):
            totals[n] += s
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        out: list[str] = []
        generator = torch.Generator(device=self._device).manual_seed(self.seed)
        eos_text = self.tokenizer.decode([self.eot_token_id])
        with self._bar(len(requests), "generate_until", disable_tqdm) as bar:
            for s in range(0, len(requests), self.batch_size):
                chunk = requests[s:s + self.batch_size]
                room = max(self.config.max_position_embeddings - (0 if self.causal else self.gen_length), 1)
                prompts = [(self.tok_encode(r.args[0]) or [self.prefix_token_id])[-room:] for r in chunk]
                for r, new in zip(chunk, self._generate(prompts, chunk, generator)):
                    text = self.tokenizer.decode(new)
                    until = r.args[1].get("until") or []
                    for stop in ([until] if isinstance(until, str) else list(until)) + [eos_text]:
                        if stop and stop in text:
                            text = text.split(stop)[0]
                    out.append(text)
                bar.update(len(chunk))
        return out

    def _generate(self, prompts: list[list[int]], chunk: list[Any], generator: torch.Generator) -> list[list[int]]:
        eos = self.eot_token_id
        pad = getattr(self.tokenizer, "pad_id", None)
        pad = eos if pad is None else pad
        ids, attn = prepare_prompts(prompts, pad_id=pad, device=self._device, vocab_size=self.config.vocab_size)
        p = ids.shape[1]
        if self.causal:
            max_new = max(int(r.args[1].get("max_gen_toks", self.gen_length)) for r in chunk)
            seq = ar_generate_tokens(self.model, ids, attn, max_new_tokens=max_new, temperature=self.temperature,
                                     eos_id=eos, generator=generator)
            return [_cut(row, eos) for row in seq[:, p:].tolist()]
        mask_id = self._need_mask("generation")
        if self.sampler == "reference":
            seq = generate_tokens(self.model, ids, attn, mask_id=mask_id, gen_length=self.gen_length,
                                  block_length=self.block_length, steps=self.steps, temperature=self.temperature,
                                  remasking=self.remasking, cfg_scale=self.cfg, eos_id=eos, generator=generator)
        else:
            seq, _ = fast_generate_tokens(self.model, ids, attn, mask_id=mask_id, gen_length=self.gen_length,
                                          block_length=self.block_length, threshold=self.threshold,
                                          steps=self.steps, cache=self.cache, temperature=self.temperature,
                                          remasking=self.remasking, cfg_scale=self.cfg, eos_id=eos,
                                          generator=generator)
        return [[t for t in _cut(row, eos) if t != mask_id] for row in seq[:, p:].tolist()]

    # ------------------------------------------------------------------ data parallel (torchrun)
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._world_size == 1:
            return tensor
        parts = [torch.zeros_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self._world_size == 1:
            return [obj]
        out = [None] * self._world_size if self._rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self._world_size > 1:
            dist.barrier()


def _cut(row: list[int], eos: int) -> list[int]:
    return row[:row.index(eos)] if eos in row else row
