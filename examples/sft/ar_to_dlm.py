"""AR-to-DLM adaptation, end to end on the CPU: a small random Hugging Face Qwen3 (no mask token) -> add the mask
token -> continue training as a masked-diffusion LM in difflm-shift and in difflm-noshift mode -> export to
Hugging Face -> load the export with transformers.

    python examples/sft/ar_to_dlm.py --work /tmp/ar2dlm [--iters 20]

Every step is a `megadlms` command (printed before it runs); the script checks what each one produced.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch


def build_ar_model(folder: Path, seed: int = 0) -> None:
    """A random 2-layer Qwen3ForCausalLM with the bundled BPE tokenizer minus its mask token (a plain AR tokenizer)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    from megadlms.data.tokenizer import default_tokenizer_path

    spec = json.loads(Tokenizer.from_file(str(default_tokenizer_path() / "tokenizer.json")).to_str())
    mask = next(t for t in spec["added_tokens"] if t["content"] == "<|mask|>")
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t is not mask]
    vocab = spec["model"]["vocab"]
    vocab.pop("<|mask|>", None)  # the id keeps a slot no string maps to; the tokenizer's size is unchanged
    vocab["<|unused|>"] = mask["id"]
    tok = Tokenizer.from_str(json.dumps(spec))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>").save_pretrained(
        str(folder))
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=0, pad_token_id=2, bos_token_id=None)
    Qwen3ForCausalLM(cfg).save_pretrained(str(folder))


def megadlms(*argv: str) -> None:
    from megadlms.cli import main

    print("$ megadlms " + " ".join(argv), flush=True)
    code = main(list(argv))
    if code:
        raise SystemExit(f"megadlms {argv[0]} failed with exit status {code}")


def run(work: Path, iters: int) -> dict:
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    build_ar_model(work / "hf_ar")
    megadlms("convert", "hf-to-megadlms", "--hf-model", str(work / "hf_ar"), "--save", str(work / "dlm_init"),
             "--add-mask-token", "--verify")
    report = {}
    for mode in ("difflm-shift", "difflm-noshift"):
        run_dir = work / mode
        megadlms("train", "--load", str(work / "dlm_init"), "--finetune", "--use-checkpoint-args",
                 "--tokenizer-model", str(work / "dlm_init" / "iter_0000000" / "tokenizer"),
                 "--model-running-mode", mode,
                 "--attention-anneal-iters", str(max(1, iters // 2)), "--seq-length", "64", "--micro-batch-size", "4",
                 "--train-iters", str(iters), "--lr", "1e-3", "--log-interval", str(iters), "--eval-iters", "0",
                 "--device", "cpu", "--no-compile", "--num-workers", "0", "--no-progress", "--save", str(run_dir),
                 "--no-generate-sample")
        export = work / f"{mode}_hf"
        megadlms("convert", "megadlms-to-hf", "--load", str(run_dir), "--save", str(export), "--verify")
        report[mode] = check_export(export, mode)
    return report


def check_export(folder: Path, mode: str) -> dict:
    """Load the export with transformers and check that the added token, the mode and mask_token_id survived."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    conf = json.loads((folder / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    mask_id = tok.convert_tokens_to_ids("<|mask|>")
    assert conf["mask_token_id"] == mask_id == tok.mask_token_id, (conf["mask_token_id"], mask_id)
    assert conf["model_running_mode"] == mode and conf["is_causal"] is False
    assert conf["vocab_size"] % 128 == 0 and conf["vocab_size"] > mask_id
    ids = tok("3 plus 4 is <|mask|>", return_tensors="pt")["input_ids"]
    assert mask_id in ids[0].tolist()
    with torch.no_grad():
        logits = model(ids).logits
    return {"mask_token_id": mask_id, "vocab_size": conf["vocab_size"], "logits": list(logits.shape),
            "finite": bool(torch.isfinite(logits).all())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/megadlms_ar_to_dlm", help="folder for every artifact (emptied first)")
    p.add_argument("--iters", type=int, default=20, help="training iterations per mode")
    args = p.parse_args(argv)
    report = run(Path(args.work), args.iters)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
