"""`megadlms convert`: Hugging Face <-> MegaDLMs checkpoints.

    megadlms convert hf-to-megadlms --hf-model DIR --save DIR [--mask-token ID | --add-mask-token [TOKEN]]
                                    [--attn-mask-type T] [--verify]
    megadlms convert megadlms-to-hf --load DIR --save DIR [--max-shard-size 5GB] [--hf-format F] [--verify]
    megadlms convert verify --load DIR --hf-model DIR       (compare an existing pair)
    megadlms convert merge-lora --load ADAPTERS --save DIR  (LoRA adapters folded into their base)
    megadlms convert megadlms-to-hf --lora --load ADAPTERS --save DIR   (a PEFT adapter folder)

Folders of Qwen3, Qwen2, Llama, LLaDA (`LLaDAModelLM`) and Dream (`DreamModel`) are read; an import is checked
(and with --verify, verified) before anything is written to --save. Exit status: 0 on success, 1 when --verify
finds the models disagree, 2 on bad input.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import zlib
from pathlib import Path

import torch

from ..config import ATTN_MASK_TYPES, ConfigError, TransformerConfig
from ..dlm_formats import OWN_FORMAT_ARCHITECTURES
from ..errors import report_errors
from ..interop.hf import (
    DEFAULT_MAX_SHARD_SIZE,
    DTYPES,
    InteropError,
    check_vocab_fits,
    copy_tokenizer_files,
    load_hf_model,
    load_hf_state_dict,
    megadlms_state_dict_to_hf,
    model_from_state_dict,
    parse_size,
    plain_state_dict,
    read_hf_config,
    save_hf_model,
    tokenizer_vocab_size,
)
from ..interop.mask_token import DEFAULT_MASK_TOKEN, VOCAB_MULTIPLE, add_mask_rows, add_token_to_tokenizer, source_rows
from ..interop.verify import DEFAULT_TOLERANCE, VerifyResult, verify_against_folder
from ..presets import HF_FORMATS
from .model_args import add_tokenizer_arguments, check_tokenizer_type


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `hf-to-megadlms` and `megadlms-to-hf` subcommands to `parser`."""
    sub = parser.add_subparsers(dest="convert_command",
                                metavar="{hf-to-megadlms,megadlms-to-hf,verify,merge-lora}")
    sub.required = True
    imp = sub.add_parser(
        "hf-to-megadlms",
        help="import a Hugging Face Qwen3 / Qwen2 / Llama / LLaDA / Dream folder as a MegaDLMs checkpoint",
        description="Import a local Hugging Face folder (config.json + safetensors, sharded or not) as a "
                    "weights-only checkpoint for `megadlms train --load DIR --finetune`. The folder's tokenizer "
                    "files (and LLaDA's / Dream's modeling code) are copied into the checkpoint. LLaDA and Dream "
                    "come in bidirectional with their mask token; Dream with the shifted prediction "
                    "(difflm-shift).")
    imp.add_argument("--hf-model", required=True, metavar="DIR", help="local Hugging Face model folder")
    imp.add_argument("--save", required=True, metavar="DIR", help="checkpoint folder to write")
    imp.add_argument("--mask-token", default=None, metavar="ID",
                     help="diffusion [MASK] id (or a token string of the tokenizer); default: config.json's "
                          "mask_token_id, if any")
    imp.add_argument("--add-mask-token", nargs="?", const=DEFAULT_MASK_TOKEN, default=None, metavar="TOKEN",
                     help=f"AR-to-DLM adaptation: add TOKEN (default {DEFAULT_MASK_TOKEN}) to the tokenizer as the "
                          "mask token, with an embedding (and head) row initialised to the mean embedding; the "
                          f"vocabulary grows to a multiple of {VOCAB_MULTIPLE} rows when the id has no row")
    imp.add_argument("--attn-mask-type", choices=ATTN_MASK_TYPES, default=None,
                     help="attention of the imported model; default: as config.json records it, else causal")
    imp.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                     help="precision to store the weights in (default float32; training loads them into its own "
                          "master-weight precision)")
    imp.add_argument("--ckpt-step", "--iteration", dest="iteration", type=int, default=0,
                     help="iteration number the written checkpoint records (default 0); --iteration is the same flag")
    _add_verify(imp)

    exp = sub.add_parser(
        "megadlms-to-hf", help="export a MegaDLMs checkpoint as a Hugging Face folder (stock architecture)",
        description="Export a checkpoint as safetensors + config.json of Qwen3ForCausalLM (QK layernorm), "
                    "Qwen2ForCausalLM (QKV bias) or LlamaForCausalLM, with mask_token_id and attn_mask_type "
                    "recorded, generation_config.json and the tokenizer files; or in LLaDA's (LLaDAModelLM) or "
                    "Dream's (DreamModel) own format, as imported or asked with --hf-format.")
    exp.add_argument("--load", required=True, metavar="DIR", help="checkpoint folder (a --save folder of training)")
    exp.add_argument("--save", required=True, metavar="DIR", help="Hugging Face folder to write")
    exp.add_argument("--ckpt-step", "--iteration", dest="iteration", type=int, default=None,
                     help="iteration to export (default: the latest; --iteration is the same flag)")
    add_tokenizer_arguments(exp, "to ship with the export; default: the checkpoint's own tokenizer/")
    exp.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                     help="dtype of the exported weights (default: the loaded model's, float32; bfloat16 halves "
                          "the size)")
    exp.add_argument("--max-shard-size", default=str(DEFAULT_MAX_SHARD_SIZE), metavar="SIZE",
                     help="largest safetensors shard, bytes or e.g. '5GB', '500MB' (default 5GB)")
    exp.add_argument("--hf-format", choices=HF_FORMATS, default="auto",
                     help="auto (default): LLaDA's, Dream's or LLaDA-MoE's own format when imported from one (a "
                          "mixture of experts: LLaDA-MoE's), else the stock transformers class; stock, llada, dream, "
                          "lladamoe: that format")
    exp.add_argument("--lora", action="store_true",
                     help="--load is a LoRA checkpoint: write its adapters as a PEFT adapter folder "
                          "(adapter_config.json, adapter_model.safetensors) for the base's export")
    exp.add_argument("--base-model-name-or-path", default=None, metavar="NAME",
                     help="--lora: the base's Hugging Face export (or hub name) to record in adapter_config.json")
    _add_lora_base(exp)
    _add_verify(exp)

    mrg = sub.add_parser(
        "merge-lora", help="fold the LoRA adapters of a checkpoint into its base: a plain MegaDLMs checkpoint",
        description="Load the base a LoRA checkpoint records (its checksum checked), add W += (alpha / r) B A to "
                    "each adapted weight (the base's own weights, not their FP8 copy), and write the merged model "
                    "as a weights-only checkpoint (`megadlms train --load DIR --finetune`, `convert megadlms-to-hf`).")
    mrg.add_argument("--load", required=True, metavar="ADAPTERS", help="LoRA checkpoint folder (a --save of training)")
    mrg.add_argument("--save", required=True, metavar="DIR", help="checkpoint folder to write")
    mrg.add_argument("--ckpt-step", "--iteration", dest="iteration", type=int, default=None,
                     help="iteration of the adapters (default: the latest; --iteration is the same flag)")
    _add_lora_base(mrg)

    ver = sub.add_parser(
        "verify", help="compare a MegaDLMs checkpoint with a Hugging Face folder (fp32, CPU)",
        description="Run the checkpoint's model and transformers' model of the folder on the same batch, under "
                    "the checkpoint's attention type; exit 1 when they disagree beyond --verify-tol.")
    ver.add_argument("--load", required=True, metavar="DIR", help="checkpoint folder")
    ver.add_argument("--hf-model", required=True, metavar="DIR", help="Hugging Face model folder")
    ver.add_argument("--ckpt-step", "--iteration", dest="iteration", type=int, default=None,
                     help="iteration to compare (default: the latest; --iteration is the same flag)")
    ver.add_argument("--verify-tol", type=float, default=DEFAULT_TOLERANCE, metavar="TOL",
                     help=f"tolerance, as for --verify (default {DEFAULT_TOLERANCE:g})")


def _add_lora_base(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-base-path", default=None, metavar="DIR",
                   help="the base of the adapters (default: the one the checkpoint records; its checksum must match)")


def _add_verify(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verify", action="store_true",
                   help="run our model and transformers' on the same batch (fp32, CPU) and fail when the logits "
                        "or the loss differ beyond --verify-tol")
    p.add_argument("--verify-tol", type=float, default=DEFAULT_TOLERANCE, metavar="TOL",
                   help=f"pass when max|dlogit| <= TOL*max(1, max|logit|) and |dloss| <= TOL*max(1, loss) "
                        f"(default {DEFAULT_TOLERANCE:g})")


def run(args: argparse.Namespace) -> int:
    """Run the subcommand in `args`; returns the exit status (0 ok, 1 verification failed, 2 bad input)."""
    commands = {"hf-to-megadlms": _hf_to_megadlms, "megadlms-to-hf": _megadlms_to_hf, "verify": _verify_pair,
                "merge-lora": _merge_lora}

    def convert() -> int:
        if args.convert_command not in commands:
            raise InteropError(f"unknown convert command {args.convert_command!r}; use {', '.join(commands)}")
        return commands[args.convert_command](args)

    return report_errors(f"megadlms convert {args.convert_command}", convert)


def _report(result: VerifyResult | str) -> int:
    if isinstance(result, str):  # a check without logits (`_round_trip`)
        print(result.split(" ", 1)[1] + (" -> PASSED" if result.startswith("PASSED") else " -> FAILED"))
        if result.startswith("PASSED"):
            return 0
        print("error: verification failed: the conversion does not reproduce the source tensors", file=sys.stderr)
        return 1
    print(result.summary())
    if not result.passed:
        print(f"error: verification failed: the converted model disagrees with transformers beyond "
              f"--verify-tol {result.tolerance:g} (see the numbers above); the weights or the config are wrong",
              file=sys.stderr)
        return 1
    return 0


def _hf_to_megadlms(args: argparse.Namespace) -> int:
    from ..training.checkpoint import save_model_checkpoint

    src = Path(args.hf_model)
    dtype = DTYPES[args.dtype]
    add_token = getattr(args, "add_mask_token", None)
    if add_token is not None and args.mask_token is not None:
        raise InteropError(f"--mask-token {args.mask_token} and --add-mask-token {add_token} both name the mask "
                           "token; pass one of them")
    model, cfg = load_hf_model(src, dtype=dtype, attn_mask_type=args.attn_mask_type, mask_token_id=args.mask_token)
    cfg.extra["hf_source"] = str(src.resolve())
    with tempfile.TemporaryDirectory() as staging:  # only the tokenizer files, not the weights next to them
        copied = copy_tokenizer_files(src, staging)
        if add_token is not None:
            mask_id = add_token_to_tokenizer(staging, add_token)
            sd, cfg = add_mask_rows(plain_state_dict(model, cfg), cfg, mask_id, add_token, tokenizer_ids=mask_id)
            model = model_from_state_dict(cfg, sd, dtype=dtype)
            print(f"added {add_token!r} as id {mask_id} (embedding rows: {cfg.vocab_size})")
        if args.verify:  # before anything is written to --save
            weights = plain_state_dict(model, cfg)
            if add_token is not None:  # compare everything but the added row with the source, at its vocabulary
                weights, verify_cfg = source_rows(weights, cfg, src, mask_id)
            else:
                verify_cfg = cfg
            rc = _report(_verify_import(weights, verify_cfg, src, args.verify_tol, dtype))
            if rc:
                print(f"nothing written to {args.save}", file=sys.stderr)
                return rc
        verified = _checksums(plain_state_dict(model, cfg)) if args.verify else {}
        existed = Path(args.save).exists()
        out = save_model_checkpoint(args.save, model, cfg, iteration=args.iteration,
                                    tokenizer_dir=staging if copied else None)
    if args.verify and not _written_as_verified(verified, args.save, args.iteration):
        shutil.rmtree(out, ignore_errors=True)  # a faulty write: take it back
        if not existed:
            shutil.rmtree(args.save, ignore_errors=True)
        print(f"error: verification failed: the checkpoint written to {out} differs from the verified weights "
              "(a faulty disk or file system?); it was removed", file=sys.stderr)
        return 1
    n_params = sum(p.numel() for p in model.parameters())
    mode = "vanilla" if cfg.causal else ("difflm-shift" if cfg.diffusion_shift else "difflm-noshift")
    print(f"imported {cfg.extra['hf_architecture']} ({n_params / 1e6:.2f}M parameters, {cfg.num_layers} layers, "
          f"vocab {cfg.vocab_size}, {'untied' if cfg.untie_embeddings_and_output_weights else 'tied'} head, "
          f"{cfg.attn_mask_type} attention, mask_token_id={cfg.mask_token_id}, {mode}) from {src} -> {out}")
    if not copied:
        print(f"warning: no tokenizer files in {src}; pass --tokenizer-model when training", file=sys.stderr)
    if cfg.attn_mask_type == "bidirectional" and cfg.mask_token_id is None:
        print("note: no mask token recorded; pass --mask-token ID for diffusion training/sampling", file=sys.stderr)
    return 0


def _checksums(weights: dict[str, torch.Tensor]) -> dict[str, int]:
    """CRC-32 of each tensor's values in fp32 (a checkpoint loads into fp32 whatever it stores), one at a time."""
    return {k: zlib.crc32(v.detach().float().contiguous().view(torch.uint8).numpy().tobytes())
            for k, v in weights.items()}


def _written_as_verified(verified: dict[str, int], save: str, iteration: int) -> bool:
    """Whether the checkpoint just written holds exactly the weights whose `_checksums` are `verified`."""
    from ..training.checkpoint import load_model_from_checkpoint

    saved, saved_cfg, _ = load_model_from_checkpoint(save, iteration=iteration)
    return _checksums(plain_state_dict(saved, saved_cfg)) == verified


def _verify_import(weights: dict[str, torch.Tensor], cfg: TransformerConfig, src: Path, tol: float,
                   dtype: torch.dtype) -> VerifyResult | str:
    """The check of an import: transformers' model of the folder against ours (stock architectures); for LLaDA
    and Dream, whose modeling code transformers does not have, the weights mapped back to the folder's own names
    and compared tensor by tensor (their logits against the reference code are what tests/interop checks)."""
    if cfg.extra.get("hf_architecture") in OWN_FORMAT_ARCHITECTURES:
        return _round_trip(weights, cfg, src, dtype)
    ours = model_from_state_dict(cfg, weights, dtype=torch.float32)
    return verify_against_folder(ours, cfg, src, tolerance=tol, vocab_limit=tokenizer_vocab_size(src),
                                 round_to=dtype)


def _round_trip(weights: dict[str, torch.Tensor], cfg: TransformerConfig, src: Path, dtype: torch.dtype) -> str:
    """'PASSED ...' when every tensor of `src` comes back from `weights` equal (after rounding to `dtype`)."""
    back = megadlms_state_dict_to_hf(weights, cfg)
    source = load_hf_state_dict(src)
    tied = [k for k in source if k not in back and k.endswith(("transformer.ff_out.weight", "lm_head.weight"))]
    differ = [k for k in back if k not in source or not torch.equal(back[k], source[k].to(dtype).to(back[k].dtype))]
    missing = [k for k in source if k not in back and k not in tied]
    what = f"verify ({cfg.extra['hf_architecture']}, weights mapped back to {src.name}'s names): {len(back)} tensors"
    if differ or missing:
        return f"FAILED {what}; differing {sorted(differ)[:4]}, not produced {sorted(missing)[:4]}"
    return f"PASSED {what} equal"


def _tokenizer_folder(path: str | None) -> str | None:
    """The folder of --tokenizer-model: the folder itself, or the one holding a tokenizer.json given by name."""
    if path is None:
        return None
    p = Path(path)
    if p.is_file():
        return str(p.parent)
    if not p.is_dir():
        raise ConfigError(f"--tokenizer-model {path}: no such file or folder; pass the tokenizer's folder (or its "
                          "tokenizer.json)")
    return path


def _merge_lora(args: argparse.Namespace) -> int:
    from ..lora import merge_lora
    from ..training.checkpoint import save_model_checkpoint
    from ..training.lora_run import load_lora_model

    model, cfg, lora, meta = load_lora_model(args.load, iteration=args.iteration, base_path=args.lora_base_path)
    n = len([m for m in model.modules() if hasattr(m, "lora_A")])
    merge_lora(model)
    out = save_model_checkpoint(args.save, model, cfg, iteration=int(meta["iteration"]),
                                tokenizer_dir=meta.get("tokenizer_dir"))
    print(f"merged {n} LoRA adapters (rank {lora.rank}, scale {lora.scaling:g}) of {meta['path']} into the base "
          f"{meta['base']} -> {out}")
    return 0


def _lora_to_peft(args: argparse.Namespace) -> int:
    from ..interop.peft import save_peft_adapter
    from ..training.lora_run import load_lora_model

    model, cfg, lora, meta = load_lora_model(args.load, iteration=args.iteration, base_path=args.lora_base_path)
    out = save_peft_adapter(model, cfg, lora, args.save, base_model_name_or_path=args.base_model_name_or_path,
                            dtype=DTYPES[args.dtype] if args.dtype is not None else None, hf_format=args.hf_format)
    print(f"exported the LoRA adapters of {meta['path']} (rank {lora.rank}, {','.join(lora.module_names())}) -> "
          f"{out} (PEFT; load it on the base {meta['base']} exported with `convert megadlms-to-hf`)")
    return 0


def _megadlms_to_hf(args: argparse.Namespace) -> int:
    from ..training.checkpoint import find_checkpoint, load_model_from_checkpoint, read_meta
    from ..training.lora_run import lora_record

    check_tokenizer_type(args)
    tokenizer_dir = _tokenizer_folder(args.tokenizer_model)
    if getattr(args, "lora", False):
        return _lora_to_peft(args)
    if lora_record(read_meta(find_checkpoint(args.load, args.iteration))) is not None:
        raise InteropError(f"{args.load} holds LoRA adapters, not a whole model: add --lora to export them for "
                           "PEFT, or fold them into the base with `megadlms convert merge-lora`")
    model, cfg, meta = load_model_from_checkpoint(args.load, iteration=args.iteration)
    tokenizer_dir = tokenizer_dir or meta.get("tokenizer_dir")
    check_vocab_fits(cfg, tokenizer_dir)
    hf_format = getattr(args, "hf_format", "auto")
    out = save_hf_model(model, cfg, args.save, tokenizer_dir=tokenizer_dir,
                        max_shard_size=parse_size(args.max_shard_size), dtype=args.dtype, hf_format=hf_format)
    shards = sorted(p.name for p in out.glob("model*.safetensors"))
    arch = read_hf_config(out)["architectures"][0]
    print(f"exported {meta.get('path', args.load)} -> {out}: {arch}, {len(shards)} safetensors file(s), "
          f"{cfg.attn_mask_type} attention, mask_token_id={cfg.mask_token_id}")
    if tokenizer_dir is None:
        print("warning: the checkpoint has no tokenizer; pass --tokenizer-model DIR so AutoTokenizer can load the "
              "export", file=sys.stderr)
    if not args.verify:
        return 0
    weights = plain_state_dict(model, cfg)
    if arch in OWN_FORMAT_ARCHITECTURES:  # no transformers class to run: the weights, name by name
        low = DTYPES[args.dtype] if args.dtype is not None else weights["embed_tokens.weight"].dtype
        export_cfg = cfg.replace(extra={**cfg.extra, "hf_architecture": arch})
        return _report(_round_trip({k: v.to(low) if v.is_floating_point() else v for k, v in weights.items()},
                                   export_cfg, out, low))
    if args.dtype is not None:  # compare against what was written, rounded like the export
        weights = {k: v.to(DTYPES[args.dtype]) if v.is_floating_point() else v for k, v in weights.items()}
    ours = model_from_state_dict(cfg, weights, dtype=torch.float32)
    result = verify_against_folder(ours, cfg, out, tolerance=args.verify_tol,
                                   vocab_limit=tokenizer_vocab_size(out))
    return _report(result)


def _verify_pair(args: argparse.Namespace) -> int:
    from ..training.checkpoint import load_model_from_checkpoint

    model, cfg, _ = load_model_from_checkpoint(args.load, iteration=args.iteration)
    weights = plain_state_dict(model, cfg)
    del model
    # Compare at the lower of the two stored precisions (an fp32 checkpoint exported as bf16 is not a defect).
    hf_conf = read_hf_config(args.hf_model)
    hf_dtype = DTYPES.get(str(hf_conf.get("dtype") or hf_conf.get("torch_dtype") or "float32"), torch.float32)
    low = hf_dtype if hf_dtype != torch.float32 else weights["embed_tokens.weight"].dtype
    arch = (hf_conf.get("architectures") or [""])[0]
    if arch in OWN_FORMAT_ARCHITECTURES:  # no transformers class to run: the weights, name by name
        pair_cfg = cfg.replace(extra={**cfg.extra, "hf_architecture": arch, "hf_config": hf_conf})
        return _report(_round_trip({k: v.to(low) if v.is_floating_point() else v for k, v in weights.items()},
                                   pair_cfg, Path(args.hf_model), low))
    ours = model_from_state_dict(cfg, {k: v.to(low) if v.is_floating_point() else v for k, v in weights.items()},
                                 dtype=torch.float32)
    return _report(verify_against_folder(ours, cfg, args.hf_model, tolerance=args.verify_tol,
                                         vocab_limit=tokenizer_vocab_size(args.hf_model), round_to=low))


def main(argv: list[str] | None = None) -> int:
    """`python -m megadlms.cli.convert ...` (the same as `megadlms convert ...`)."""
    parser = argparse.ArgumentParser(prog="megadlms convert", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
