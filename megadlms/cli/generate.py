"""`megadlms generate`: sample text from a checkpoint, an exported Hugging Face folder or an FP8 export.

Diffusion models (bidirectional) use the fast sampler on GPU and LLaDA's reference sampler on
CPU unless --sampler says otherwise (--sampler dream: Dream's decoding orders, --alg);
block-diffusion (bd3lm) models decode block by block with a KV cache of the finished blocks;
causal (vanilla) models decode autoregressively.

    megadlms generate --load runs/tiny --prompt "Once upon a time" --gen-length 64 --block-length 32
    megadlms generate --hf-model export/ --prompt-file in.jsonl --output-file out.jsonl --sampler fast
    megadlms generate --hf-model dream/ --prompt "Hi" --sampler dream --alg entropy --steps 64 --gen-length 64
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from ..config import ConfigError
from ..diffusion.bd3lm_sampler import bd3lm_generate_tokens, generated_rows
from ..diffusion.dream_sampler import DREAM_ALGS, dream_generate_tokens
from ..diffusion.fast_sampler import fast_generate_tokens
from ..diffusion.sampler import REMASKING, generate_tokens, prepare_prompts
from ..dlm_formats import DREAM_ARCHITECTURE
from ..errors import report_errors
from ..generate.ar import ar_generate_tokens
from ..jsonl import read_jsonl
from .model_args import add_model_source, check_tokenizer_type

if TYPE_CHECKING:
    from ..model import TransformerLM


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = p.add_argument_group("model")
    add_model_source(g)
    g.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="weights dtype: auto = bf16 on GPU, fp32 on CPU (FP8 exports keep their own)")

    g = p.add_argument_group("prompts")
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    g.add_argument("--prompt-file", metavar="FILE.jsonl", help='one JSON object per line with a "prompt" key')
    g.add_argument("--chat", action="store_true",
                   help="render each prompt as a user turn with the tokenizer's chat template and its generation "
                        "prompt (as the conversations of `preprocess --chat`), or with --prompt-template")
    g.add_argument("--prompt-template", default=None,
                   help="with --chat, for tokenizers without a chat template: e.g. 'User: {prompt}\\nAssistant: '")
    g.add_argument("--output-file", metavar="FILE.jsonl",
                   help='write each input record plus "completion" and "num_tokens" as jsonl')
    g.add_argument("--micro-batch-size", "--batch-size", dest="batch_size", type=int, default=8,
                   help="prompts per forward (default 8); --batch-size is the same flag")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--eos-token", type=int, default=None, help="stop token (default: the tokenizer's EOD)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop or cut at EOS")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (there is none unless stderr is a "
                   "terminal)")

    g = p.add_argument_group("diffusion sampling")
    g.add_argument("--sampler", choices=("reference", "fast", "bd3lm", "dream"), default=None,
                   help="reference: LLaDA's sampler; fast: KV cache + parallel decoding (default: fast on GPU, "
                        "reference on CPU); bd3lm: block diffusion, variable length up to --max-new-tokens "
                        "(the default for a model trained with --model-running-mode bd3lm); dream: Dream's "
                        "diffusion_generate over the whole --gen-length (no blocks), order by --alg (the default "
                        "for a model imported from Dream)")
    g.add_argument("--gen-length", type=int, default=None,
                   help="reference, fast and dream samplers: tokens to generate (default 128)")
    g.add_argument("--block-length", type=int, default=None,
                   help="reference and fast samplers: semi-autoregressive blocks (default 32)")
    g.add_argument("--steps", type=int, default=None,
                   help="reference and dream sampler steps (default: --gen-length)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--remasking", choices=REMASKING, default="low_confidence")
    g.add_argument("--cfg-scale", type=float, default=0.0)
    g.add_argument("--alg", choices=DREAM_ALGS, default=None,
                   help="dream sampler (default origin, as Dream): which masked positions to reveal each step: "
                        "origin (at random, each with probability 1 - s/t), or the most confident by maskgit_plus "
                        "(probability), topk_margin (top-1 minus top-2) or entropy (negative entropy)")
    g.add_argument("--alg-temp", type=float, default=None,
                   help="dream sampler: draw the positions from softmax(confidence / T) instead of taking the top")
    g.add_argument("--top-k", type=int, default=None, help="dream sampler: sample tokens among the top k only")
    g.add_argument("--threshold", type=float, default=None,
                   help="fast sampler (default 0.9) and bd3lm (default: --block-steps): commit every position "
                        "above this confidence (at least one per step)")
    g.add_argument("--block-steps", type=int, default=None,
                   help="bd3lm sampler: denoising steps per block (default: the block size, one token a step)")
    g.add_argument("--cache", choices=("dual", "prefix", "none"), default="dual", help="fast sampler KV cache")
    g.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="capture the sampler's fixed-shape forwards in CUDA graphs (default: on for GPU)")
    g.add_argument("--fuse-projections", action=argparse.BooleanOptionalAction, default=None,
                   help="run q/k/v and gate/up as one GEMM each (default: on for GPU; megadlms.generate.fuse)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer layer (fused norms, RoPE and SwiGLU; the first batch pays "
                        "the compilation) for the diffusion samplers; AR decoding runs eagerly")
    g.add_argument("--mask-token", type=int, default=None,
                   help="the [MASK] id (default: the model config's mask_token_id, else the tokenizer's)")

    g = p.add_argument_group("autoregressive and block-diffusion models")
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help="AR and bd3lm: the most tokens to generate (default 128)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling (with --temperature > 0): AR, bd3lm and dream; BD3-LM's paper samples with "
                        "--remasking random --temperature 1 --top-p 0.9 (one token a step, the first-hitting order)")
    g.add_argument("--context-window", type=int, default=None,
                   help="bd3lm: the sliding window in tokens (whole blocks) each block sees, so generation goes past "
                        "the model's positions (default: the model's max_position_embeddings)")
    g.add_argument("--var-length", action="store_true",
                   help="bd3lm: the reference's variable-length rule: a row stops at the second EOS of its text "
                        "(prompt included; the paper's samples open with BOS = EOS) and keeps it")
    g.add_argument("--entropy-floor", type=float, default=None,
                   help="bd3lm: stop a row whose last --entropy-window tokens have a unigram entropy below this "
                        "(nats; degenerate repetition) and cut them off (the reference: 4; default off)")
    g.add_argument("--entropy-window", type=int, default=None,
                   help="bd3lm: the tokens --entropy-floor looks at (default 256, the reference's)")
    return p


def eager_if_compiled(compiled: bool) -> contextlib.AbstractContextManager:
    """For AR decoding under --compile: its key length grows by one every forward, a new shape for the compiled
    layers each time, so it runs eagerly. (The diffusion samplers run compiled: the cache is called outside the
    graphs, and their shapes are fixed per call.) set_stance switches on being called: make one per `with`."""
    return torch.compiler.set_stance("force_eager") if compiled else contextlib.nullcontext()


def _load_tokenizer(path: str | None) -> Any:
    from ..data import load_tokenizer

    return load_tokenizer(path)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: CUDA is not available here; use --device cpu")
    return dev


def load_model(args: argparse.Namespace, device: torch.device) -> tuple[TransformerLM, Any, str | None]:
    """(model in eval mode on `device`, its TransformerConfig, the tokenizer path to use)."""
    from ..eval.loading import load_model as load_source

    model, cfg, tok = load_source(load=args.load, hf_model=args.hf_model, fp8_export=args.fp8_export,
                                  iteration=args.iteration, device=device, dtype=args.dtype)
    return cast("TransformerLM", model), cfg, args.tokenizer_model or tok


# the length flags each sampler reads (with their defaults); another sampler's is refused, not silently ignored
LENGTH_FLAGS = {"ar": ("--max-new-tokens",), "bd3lm": ("--max-new-tokens",), "dream": ("--gen-length", "--steps"),
                "reference": ("--gen-length", "--block-length", "--steps"), "fast": ("--gen-length", "--block-length")}
LENGTH_DEFAULTS = {"gen_length": 128, "block_length": 32, "max_new_tokens": 128}


def check_length_flags(args: argparse.Namespace, sampler: str) -> None:
    """Refuse the length flags `sampler` does not read (`--gen-length` for a bd3lm model, ...); fill the defaults of
    the others."""
    reads = LENGTH_FLAGS[sampler]
    wrong = [f for f in ("--gen-length", "--block-length", "--steps", "--max-new-tokens")
             if getattr(args, f[2:].replace("-", "_")) is not None and f not in reads]
    if wrong:
        raise ConfigError(f"{' and '.join(wrong)} {'apply' if len(wrong) > 1 else 'applies'} to other samplers, not "
                          f"the {sampler} sampler; its length flags are {' and '.join(reads)}")
    for name, default in LENGTH_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def _read_prompts(args: argparse.Namespace) -> list[dict[str, Any]]:
    records = [{"prompt": p} for p in args.prompt]
    if args.prompt_file:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise ConfigError(f"--prompt-file {path} does not exist")
        for n, rec in read_jsonl(path):
            if not isinstance(rec.get("prompt"), str):
                raise ConfigError(f'{path}:{n} needs a "prompt" string, got the keys {sorted(rec)[:10]}')
            records.append(rec)
    if not records:
        raise ConfigError("no prompts: pass --prompt TEXT (repeatable) or --prompt-file FILE.jsonl")
    return records


def _check_args(args: argparse.Namespace) -> None:
    if args.batch_size <= 0:
        raise ConfigError(f"--micro-batch-size {args.batch_size} must be > 0")


class _StepCounter:
    """A progress callback that counts steps (and shows a tqdm bar when asked)."""

    def __init__(self, show: bool):
        self.n, self.show, self.bar = 0, show, None
        self.total: int | None = None

    def start(self, total: int) -> _StepCounter:
        self.total = total  # the bar opens at the first step: an argument error is not preceded by an empty bar
        return self

    def __call__(self, k: int) -> None:
        self.n += k
        if self.show and self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, unit="step", dynamic_ncols=True, leave=False)
        if self.bar is not None:
            self.bar.update(k)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def run(args: argparse.Namespace) -> int:
    """Run `megadlms generate`; returns the process exit code (2 on bad input, printed as one line)."""
    return report_errors("megadlms generate", lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    _check_args(args)
    check_tokenizer_type(args)
    records = _read_prompts(args)
    if args.output_file:  # an unwritable path fails now, not after the generation
        Path(args.output_file).open("a").close()
    device = _device(args.device)
    model, cfg, tok_path = load_model(args, device)
    if args.fuse_projections if args.fuse_projections is not None else device.type == "cuda":
        from ..generate.fuse import fuse_projections

        fuse_projections(model)  # after load_model has set the final device and dtype
    if args.compile:
        from ..distributed.parallelize import apply_compile

        apply_compile(model)
    tokenizer = _load_tokenizer(tok_path)
    eos = None if args.ignore_eos else (args.eos_token if args.eos_token is not None else tokenizer.eod_id)
    causal = cfg.attn_mask_type == "causal"
    mask_id = args.mask_token
    if not causal and mask_id is None:
        mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else getattr(tokenizer, "mask_id", None)
        if mask_id is None:
            raise ConfigError("no mask token id: the model config has no mask_token_id and the tokenizer no mask "
                             "token; pass --mask-token ID (the id the model was trained with)")
    dream = (cfg.extra or {}).get("hf_architecture") == DREAM_ARCHITECTURE  # a model imported from Dream
    sampler = "ar" if causal else args.sampler or ("bd3lm" if cfg.block_size else "dream" if dream else
                                                   "fast" if device.type == "cuda" else "reference")
    dream_flags = [f for f, v in (("--alg", args.alg), ("--alg-temp", args.alg_temp), ("--top-k", args.top_k))
                   if v is not None]
    if dream_flags and sampler != "dream":
        raise ConfigError(f"{' and '.join(dream_flags)} {'apply' if len(dream_flags) > 1 else 'applies'} to Dream's "
                          f"sampler, not the {sampler} sampler; "
                          "add --sampler dream")
    bd3lm_flags = [f for f, on in (("--context-window", args.context_window is not None),
                                   ("--var-length", args.var_length),
                                   ("--entropy-floor", args.entropy_floor is not None)) if on]
    if bd3lm_flags and sampler != "bd3lm":
        raise ConfigError(f"{' and '.join(bd3lm_flags)} {'apply' if len(bd3lm_flags) > 1 else 'applies'} to the bd3lm "
                          f"sampler, not the {sampler} sampler; use a block-diffusion model (or --sampler bd3lm)")
    if args.entropy_window is not None and args.entropy_floor is None:
        raise ConfigError(f"--entropy-window {args.entropy_window} is the window of --entropy-floor, which is off; add "
                          "--entropy-floor H (the reference's is 4) or drop it")
    entropy_window = 256 if args.entropy_window is None else args.entropy_window  # the reference's window
    check_length_flags(args, sampler)
    if args.var_length and eos is None:
        raise ConfigError("--var-length stops at the second EOS: drop --ignore-eos")
    cuda_graph = device.type == "cuda" if args.cuda_graph is None else args.cuda_graph
    pad_id = getattr(tokenizer, "pad_id", None)
    pad_id = pad_id if pad_id is not None else (eos if eos is not None else 0)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    progress = not args.no_progress and sys.stderr.isatty()  # no bar in a log file, as train
    counter = _StepCounter(progress)

    completions: list[tuple[str, int]] = []
    produced = forwards = 0
    t0 = time.perf_counter()
    encode = tokenizer.encode
    if args.chat:
        from ..data.chat import ChatRenderer

        encode = ChatRenderer(tokenizer, prompt_template=args.prompt_template).encode_prompt
    for i in range(0, len(records), args.batch_size):
        batch = [encode(r["prompt"]) for r in records[i:i + args.batch_size]]
        ids, attn = prepare_prompts(batch, pad_id=pad_id, device=device, vocab_size=cfg.vocab_size)
        p = ids.shape[1]
        if sampler == "ar":
            with eager_if_compiled(args.compile):
                out = ar_generate_tokens(model, ids, attn, max_new_tokens=args.max_new_tokens,
                                         temperature=args.temperature, top_p=args.top_p, eos_id=eos,
                                         generator=generator, progress=progress)
            forwards += out.shape[1] - p
        elif sampler == "bd3lm":
            x, start, nfe = bd3lm_generate_tokens(model, ids, attn, mask_id=mask_id, max_new_tokens=args.max_new_tokens,
                                                  steps=args.block_steps, threshold=args.threshold,
                                                  temperature=args.temperature, remasking=args.remasking, eos_id=eos,
                                                  top_p=args.top_p, context_window=args.context_window,
                                                  var_length=args.var_length, entropy_floor=args.entropy_floor,
                                                  entropy_window=entropy_window,
                                                  generator=generator, progress=progress)
            forwards += nfe
            for row in generated_rows(x, start, args.max_new_tokens, eos_id=None, mask_id=mask_id):
                if eos is not None and eos in row and not args.var_length:  # var-length keeps its second EOS
                    produced += 1  # the EOS was decoded too
                    row = row[:row.index(eos)]
                produced += len(row)
                completions.append((tokenizer.decode(row), len(row)))
            continue
        elif sampler == "dream":
            counter.start(args.steps or args.gen_length)
            try:
                out = dream_generate_tokens(model, ids, attn, mask_id=mask_id, gen_length=args.gen_length,
                                            steps=args.steps, alg=args.alg or "origin", alg_temp=args.alg_temp,
                                            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                            generator=generator, progress=counter)
            finally:
                counter.close()
        elif sampler == "reference":
            counter.start(args.steps or args.gen_length)
            try:
                out = generate_tokens(model, ids, attn, mask_id=mask_id, gen_length=args.gen_length,
                                      block_length=args.block_length, steps=args.steps,
                                      temperature=args.temperature, remasking=args.remasking,
                                      cfg_scale=args.cfg_scale, eos_id=eos, generator=generator, progress=counter,
                                      cuda_graph=cuda_graph)
            finally:
                counter.close()
        else:
            out, nfe = fast_generate_tokens(model, ids, attn, mask_id=mask_id, gen_length=args.gen_length,
                                            block_length=args.block_length,
                                            threshold=0.9 if args.threshold is None else args.threshold,
                                            cache=None if args.cache == "none" else args.cache,
                                            temperature=args.temperature, remasking=args.remasking,
                                            cfg_scale=args.cfg_scale, eos_id=eos, generator=generator,
                                            progress=progress, cuda_graph=cuda_graph)
            forwards += nfe
        new = out[:, p:]
        if sampler != "ar":  # positions decoded (an EOS stop leaves later blocks masked)
            produced += int((new != mask_id).sum())
        for row in new.tolist():
            if sampler == "ar":
                produced += len(row) if eos is None or eos not in row else row.index(eos) + 1
            if eos is not None and eos in row:
                row = row[:row.index(eos)]
            if mask_id is not None:
                row = [t for t in row if t != mask_id]
            completions.append((tokenizer.decode(row), len(row)))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0

    if args.output_file:
        with open(args.output_file, "w") as f:
            for rec, (text, n) in zip(records, completions):
                f.write(json.dumps({**rec, "completion": text, "num_tokens": n}, ensure_ascii=False) + "\n")
    else:
        for rec, (text, _) in zip(records, completions):
            print(f">>> {rec['prompt']}\n{text}\n")
    if sampler in ("reference", "dream"):
        forwards = counter.n
    n = len(records)
    print(f"[{sampler}] {produced} tokens in {elapsed:.2f} s: {produced / max(elapsed, 1e-9):.1f} tokens/s "
          f"({forwards} forwards, {n} prompt{'' if n == 1 else 's'}, batch size {min(args.batch_size, n)}, "
          f"{device.type})", file=sys.stderr)
    if args.output_file:
        print(f"wrote {len(records)} completions to {args.output_file}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(prog="megadlms generate", description=__doc__.split("\n")[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
