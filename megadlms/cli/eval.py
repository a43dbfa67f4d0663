"""`megadlms eval`: benchmarks through lm-evaluation-harness, or the validation ELBO per mask ratio (--ppl).

    megadlms eval --load runs/tiny --tasks hellaswag,arc_easy --num-fewshot 0 --model-args mc_num=128
    megadlms eval --load runs/tiny --tasks my_task --include-path tasks/ --output-path results/
    megadlms eval --ppl --load runs/fp8 --compare runs/bf16 --data-path data/corpus_text_document
    megadlms eval --ppl --load runs/demo     # no --data-path: the bundled demo corpus's validation split

Under torchrun the harness splits the documents across ranks and rank 0 prints and writes the results.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import torch

from ..config import ConfigError
from ..diffusion.objective import DIFFUSION_LOSSES
from ..errors import import_extra
from ..eval.likelihood import DEFAULT_RATIOS
from .model_args import add_model_source, check_tokenizer_type


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = p.add_argument_group("model")
    add_model_source(g)
    g.add_argument("--mask-token", type=int, default=None, help="the [MASK] id (default: the model config's)")
    g.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="weights dtype: auto = bf16 on GPU, fp32 on CPU (FP8 models keep their FP8 layers)")
    g.add_argument("--micro-batch-size", "--batch-size", dest="batch_size", type=int, default=8,
                   help="rows per forward (default 8); --batch-size is the same flag")
    g.add_argument("--seed", type=int, default=1234, help="seeds the Monte-Carlo masks, samplers and few-shot draws")
    g.add_argument("--output-path", metavar="DIR", default=None, help="write results.json (and the table) here")

    g = p.add_argument_group("lm-evaluation-harness")
    g.add_argument("--tasks", default=None, help="comma-separated task names (harness tasks or --include-path ones)")
    g.add_argument("--include-path", metavar="DIR", default=None, help="a folder of task YAML files to add")
    g.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples per prompt")
    g.add_argument("--limit", type=float, default=None, help="documents per task (a fraction when < 1)")
    g.add_argument("--apply-chat-template", action="store_true",
                   help="render prompts with the tokenizer's chat_template (instruction-tuned models)")
    g.add_argument("--model-args", default="",
                   help="k=v,... for the model class: mc_num, cfg, greedy, elbo_ratios, sampler, gen_length, "
                        "block_length, steps, threshold, cache, remasking, temperature, max_length")
    g.add_argument("--log-samples", action="store_true", help="with --output-path: also write every sample")

    g = p.add_argument_group("validation ELBO (--ppl)")
    g.add_argument("--ppl", action="store_true", help="the deterministic ELBO per mask ratio on the validation split "
                                                      "of --data-path (or the bundled corpus) instead of harness tasks")
    g.add_argument("--data-path", metavar="PREFIX", default=None,
                   help="a Megatron dataset prefix (.bin/.idx); omit for the bundled demo corpus (as `train` does)")
    g.add_argument("--split", default=None,
                   help="train,valid,test proportions (the validation part is used; default 969,30,1, and 98,1,1 "
                        "for the bundled corpus, as in training)")
    g.add_argument("--data-cache-path", default=None, help="folder for the cached sample index")
    g.add_argument("--eval-samples", type=int, default=64,
                   help="validation windows to score (default 64); train's --eval-iters counts global batches "
                        "instead: a validation there scores eval-iters x global-batch-size windows")
    g.add_argument("--eval-iters", type=int, default=None, help=argparse.SUPPRESS)  # refused: see _run_ppl
    g.add_argument("--seq-length", type=int, default=None, help="window length (default: the model's seq_length)")
    g.add_argument("--diffusion-loss", choices=DIFFUSION_LOSSES, default=None,
                   help="the diffusion bounds' cross-entropy: subs (MDLM's SUBS, as training defaults: [MASK] "
                        "out of the softmax, the bound of the model that samples) or full-vocab (LLaDA's). "
                        "Default: the one each model records (full-vocab for LLaDA, LLaDA-MoE and Dream), else subs")
    g.add_argument("--ignore-bos", action="store_true",
                   help="never mask a window's first token and leave it out of the bounds (MDLM / BD3-LM's "
                        "ignore_bos, for models trained with train --ignore-bos)")
    g.add_argument("--mask-ratios", default=",".join(map(str, DEFAULT_RATIOS)), help="comma-separated ratios")
    g.add_argument("--compare", metavar="DIR", default=None,
                   help="a second checkpoint (or Hugging Face folder) scored on the same windows and masks")
    return p


def run(args: argparse.Namespace) -> int:
    """Run `megadlms eval`: harness tasks, or with --ppl the validation ELBO; returns the exit status."""
    if args.batch_size < 1:
        raise ConfigError(f"--micro-batch-size {args.batch_size} must be >= 1")
    check_tokenizer_type(args)
    if args.ppl:
        return _run_ppl(args)
    if not args.tasks:
        raise ConfigError("no tasks: pass --tasks NAME[,NAME...] (or --ppl [--data-path PREFIX] for the ELBO)")
    return _run_harness(args)


# --------------------------------------------------------------------------- harness tasks


def task_manager(include_path: str | None, names: list[str]) -> Any:
    """lm_eval's TaskManager holding `names`: the --include-path tasks alone when they are all there (indexing the
    harness's own thousands of tasks takes a while), else those plus the harness's."""
    import_extra("lm_eval", "eval", "megadlms eval")
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        if not Path(include_path).is_dir():
            raise ConfigError(f"--include-path {include_path} is not a folder; pass the folder holding the task "
                             "YAMLs")
        local = TaskManager(include_path=include_path, include_defaults=False)
        if not _unknown(local, names):
            return local
    manager = TaskManager(include_path=include_path)
    unknown = _unknown(manager, names)
    if unknown:
        raise ConfigError(f"unknown task(s) {unknown}; `lm_eval ls tasks` lists the harness's tasks, and "
                         "--include-path DIR adds the YAML tasks of a folder")
    return manager


def _unknown(manager: Any, names: list[str]) -> list[str]:
    known = set(manager.all_tasks)
    return [n for n in names if n not in known and not manager.match_tasks([n])]


# model-args keys that a flag of this command also sets: key -> (the flag's dest, the flag)
FLAG_KEYS = {"load": ("load", "--load"), "hf_model": ("hf_model", "--hf-model"),
             "fp8_export": ("fp8_export", "--fp8-export"), "iteration": ("iteration", "--ckpt-step"),
             "mask_token": ("mask_token", "--mask-token"), "tokenizer": ("tokenizer_model", "--tokenizer-model"),
             "device": ("device", "--device"), "dtype": ("dtype", "--dtype"),
             "batch_size": ("batch_size", "--micro-batch-size"), "seed": ("seed", "--seed")}


def model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The model class's settings: --model-args, and the flags that set the same keys. A key given in --model-args
    is kept where its flag is left at its default; given both ways with different values, it is an error."""
    from lm_eval.utils import simple_parse_args_string

    kwargs: dict[str, Any] = simple_parse_args_string(args.model_args)
    defaults = add_arguments(argparse.ArgumentParser())
    for key, (dest, flag) in FLAG_KEYS.items():
        value = getattr(args, dest)
        if key not in kwargs:
            if value is not None:
                kwargs[key] = value
        elif value != defaults.get_default(dest) and str(value) != str(kwargs[key]):
            raise ConfigError(f"--model-args {key}={kwargs[key]} contradicts {flag} {value}; give the value once")
    return kwargs


def _git_hash_of_cwd() -> str | None:
    """The commit of the working folder's git checkout, None outside one (git's own error kept off stderr)."""
    try:
        out = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


@contextlib.contextmanager
def quiet_git_hash() -> Iterator[None]:
    """lm_eval records the working folder's commit in its results by running `git describe`, whose "fatal: not a
    git repository" reaches the terminal outside a checkout: the same record, without that line."""
    import lm_eval.evaluator

    original = lm_eval.evaluator.get_git_commit_hash
    lm_eval.evaluator.get_git_commit_hash = _git_hash_of_cwd
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash = original


def _run_harness(args: argparse.Namespace) -> int:
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    manager = task_manager(args.include_path, names)
    import lm_eval
    from lm_eval.utils import make_table

    from ..eval.harness import MegaDLMsLM

    kwargs = model_kwargs(args)
    known = set(inspect.signature(MegaDLMsLM.__init__).parameters) - {"self", "model"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ConfigError(f"unknown --model-args key(s) {unknown}; the keys are {sorted(known)}")
    lm = MegaDLMsLM(**kwargs)
    with quiet_git_hash():
        results = lm_eval.simple_evaluate(
            model=lm, tasks=names, task_manager=manager, num_fewshot=args.num_fewshot, limit=args.limit,
            apply_chat_template=args.apply_chat_template, log_samples=args.log_samples, random_seed=args.seed,
            numpy_random_seed=args.seed, torch_random_seed=args.seed, fewshot_random_seed=args.seed,
            bootstrap_iters=0 if args.limit else 1000)
    if results is None:  # not rank 0
        return 0
    table = make_table(results) + ("\n" + make_table(results, "groups") if results.get("groups") else "")
    print(table)
    if args.output_path:
        out = Path(args.output_path)
        out.mkdir(parents=True, exist_ok=True)
        samples = results.pop("samples", None)
        (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
        (out / "results.md").write_text(table + "\n")
        if samples:
            for task, rows in samples.items():
                with open(out / f"samples_{task}.jsonl", "w") as f:
                    for row in rows:
                        f.write(json.dumps(row, default=str) + "\n")
        print(f"wrote {out / 'results.json'}", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------- --ppl


def _ratios(text: str) -> list[float]:
    try:
        ratios = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ConfigError(f"--mask-ratios {text!r} is not a comma-separated list of numbers, e.g. 0.1,0.5,1.0") from e
    if not ratios or any(not 0.0 < r <= 1.0 for r in ratios):
        raise ConfigError(f"--mask-ratios {text!r}: every ratio must be in (0, 1], e.g. 0.1,0.2,...,1.0")
    return ratios


def _run_ppl(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from ..data import bundled_dataset, load_tokenizer
    from ..data.dataset import user_cache_dir
    from ..data.loader import BUNDLED_SPLIT, DEFAULT_SPLIT, check_data_paths
    from ..distributed.init import init_parallel
    from ..eval.loading import load_model, model_folder_kind
    from ..eval.validation import (
        format_ppl_table,
        model_report,
        objective_loss_sum,
        score_windows,
        scored_tokens,
        validation_windows,
    )

    if args.eval_iters is not None:  # train's flag counts global batches, not windows: not an alias
        raise ConfigError(f"eval counts validation windows, not batches: use --eval-samples N (train's --eval-iters "
                          f"{args.eval_iters} scores {args.eval_iters} x global-batch-size windows)")
    ratios = _ratios(args.mask_ratios)
    if args.eval_samples < 1:
        raise ConfigError(f"--eval-samples {args.eval_samples} must be >= 1")
    if args.data_path:
        check_data_paths([args.data_path])  # before a model is loaded
    ctx = init_parallel(None if args.device == "auto" else args.device)
    model, cfg, tok_dir = load_model(load=args.load, hf_model=args.hf_model, fp8_export=args.fp8_export,
                                     iteration=args.iteration, device=ctx.device, dtype=args.dtype)
    models = [(args.load or args.hf_model or args.fp8_export, model, cfg)]
    if args.compare:
        source = model_folder_kind(args.compare) or "load"  # the loader's error names what the folder lacks
        other, other_cfg, _ = load_model(**{source: args.compare}, device=ctx.device, dtype=args.dtype)
        models.append((args.compare, other, other_cfg))
    tokenizer = load_tokenizer(args.tokenizer_model or tok_dir)
    seq_length = args.seq_length or cfg.seq_length
    for _, _, c in models:
        if seq_length > c.max_position_embeddings:
            raise ConfigError(f"--seq-length {seq_length} exceeds max_position_embeddings={c.max_position_embeddings}")
    data_path, split = args.data_path, args.split or DEFAULT_SPLIT
    if not data_path:  # the corpus `megadlms train` trains on with no --data-path, split as it splits it
        if ctx.is_main:
            print("megadlms eval: no --data-path: the validation split of the bundled demo corpus", file=sys.stderr)
        data_path, split = bundled_dataset(tokenizer, user_cache_dir()), args.split or BUNDLED_SPLIT
    mask_ids = [args.mask_token if args.mask_token is not None else c.mask_token_id for _, _, c in models
                if c.running_mode != "vanilla"]  # a window holding a diffusion model's [MASK] id is refused
    windows = validation_windows(tokenizer, data_path=data_path, seq_length=seq_length, samples=args.eval_samples,
                                 split=split, seed=args.seed, data_cache_path=args.data_cache_path,
                                 mask_token_ids=[m for m in mask_ids if m is not None])
    mine = windows[ctx.rank::ctx.world_size]  # under torchrun each rank scores its share; the sums are reduced
    losses = [args.diffusion_loss or c.loss for _, _, c in models]  # the flag, else what each model records
    report: dict[str, Any] = {"data_path": data_path, "split": split, "windows": len(windows),
                              "seq_length": seq_length, "mask_ratios": ratios,
                              "loss": losses[0] if len(set(losses)) == 1 else None, "ignore_bos": args.ignore_bos,
                              "models": {}}
    for (name, m, c), loss in zip(models, losses):
        mask_id = args.mask_token if args.mask_token is not None else c.mask_token_id
        with torch.no_grad():
            total = score_windows(m, c, mine, seq_length=seq_length, ratios=ratios, mask_id=mask_id,
                                  seed=args.seed, batch_size=args.batch_size,
                                  loss=loss, ignore_bos=args.ignore_bos).to(ctx.device)
            objective = objective_loss_sum(m, c, mine, seq_length=seq_length, mask_id=mask_id, seed=args.seed,
                                           batch_size=args.batch_size, loss=loss,
                                           ignore_bos=args.ignore_bos)
        if ctx.world_size > 1:
            dist.all_reduce(total)
        counted = len(windows) * scored_tokens(c, seq_length, args.ignore_bos)
        report["models"][name] = {**model_report(c, (total / counted).tolist()), "loss": loss}
        if objective is not None:
            summed = torch.tensor([objective], dtype=torch.float64, device=ctx.device)
            if ctx.world_size > 1:
                dist.all_reduce(summed)
            report["models"][name]["objective_loss"] = float(summed) / len(windows)
    if ctx.rank != 0:
        return 0
    table = format_ppl_table(report)
    print(table)
    if args.output_path:
        out = Path(args.output_path)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ppl.json").write_text(json.dumps(report, indent=2))
        (out / "ppl.md").write_text(table + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`megadlms eval ARGV`, with its one-line errors."""
    from . import run_command

    return run_command("eval", sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
