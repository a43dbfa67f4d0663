#!/usr/bin/env python
"""Record the reference logits of tiny random LLaDA and Dream models, computed by the models' own modeling code.

The modeling code is not part of MegaDLMs (it ships with the models; ZHZisZZ/dllm keeps copies under
`dllm/pipelines/{llada,dream}/models/`), and the transformers it is written for (4.46) differs from ours, so this
runs outside the test suite: point it at folders holding the code, in an environment with transformers 4.46.

    python tools/make_dlm_reference.py --llada-code DIR --dream-code DIR [--out tests/interop/data]
    python tools/make_dlm_reference.py --llada-code DIR --dream-code DIR --check-export EXPORT_DIR
    python tools/make_dlm_reference.py --dream-code DIR --generate [--out tests/interop/data]
    python tools/make_dlm_reference.py --lladamoe-code DIR --models lladamoe [--out tests/interop/data]

The first form writes, per model, an HF folder `<name>/` (config.json + model.safetensors, as the reference
class's save_pretrained writes them) and `<name>_reference.safetensors` holding the inputs and the fp32 logits
(`input_ids` [2, 16] with mask tokens, `attention_mask` [2, 16] with row 1 right-padded, `logits` of the unpadded
call, `logits_padded` of the padded one). The second loads an exported folder with the reference class and prints
the largest logit difference against ours at the same path's `_reference.safetensors` inputs. The third runs
Dream's own `diffusion_generate` (its generation_utils.py) on the recorded `dream/` folder for each decoding order
in GEN_CASES and writes the prompts, arguments, seeds and output tokens to `dream_generate_reference.json`.

Models: `llada_llama` (block type llama, untied head, 4 heads / 2 KV heads, vocabulary padded 300 -> 320 rows),
`llada_sequential` (fused att_proj/ff_proj, q/k/v bias, tied head), `dream` (Qwen2.5 shapes: q/k/v bias, 4 / 2
heads, untied head), `lladamoe` (LLaDA-MoE: 3 layers, the first dense, then 4 experts top-2 with a shared
expert, QK norm; its code is `configuration_lladamoe.py` / `modeling_lladamoe.py`, `--lladamoe-code`). Weights:
normal(0, 0.15), norm weights 1 + normal(0, 0.2), seeds fixed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "tests" / "interop" / "data"
SEQ, BATCH = 16, 2

LLADA_COMMON = dict(d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=300, embedding_size=320,
                    rope=True, rope_theta=500000.0, layer_norm_type="rms", rms_norm_eps=1e-5, alibi=False,
                    include_bias=False, bias_for_layer_norm=False, attention_dropout=0.0, residual_dropout=0.0,
                    embedding_dropout=0.0, max_sequence_length=128, mask_token_id=299, eos_token_id=0,
                    pad_token_id=2, flash_attention=False, block_group_size=1, input_emb_norm=False,
                    scale_logits=False, attention_layer_norm=False, init_device="cpu", init_fn="normal")
LLADA_AUTO_MAP = {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM",
                  "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"}
DREAM_AUTO_MAP = {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"}
LLADA_MOE_AUTO_MAP = {"AutoConfig": "configuration_lladamoe.LLaDAMoEConfig",
                      "AutoModel": "modeling_lladamoe.LLaDAMoEModelLM",
                      "AutoModelForCausalLM": "modeling_lladamoe.LLaDAMoEModelLM"}
MODELS = {
    "llada_llama": dict(LLADA_COMMON, block_type="llama", activation_type="silu", mlp_hidden_size=64,
                        weight_tying=False, include_qkv_bias=False),
    "llada_sequential": dict(LLADA_COMMON, block_type="sequential", activation_type="swiglu", mlp_hidden_size=128,
                             weight_tying=True, include_qkv_bias=True),
    "dream": dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rope_theta=1e6, rms_norm_eps=1e-6,
                  mask_token_id=298, pad_token_id=2, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False),
    "lladamoe": dict(vocab_size=300, hidden_size=32, dense_intermediate_size=64, expert_intermediate_size=16,
                     shared_expert_intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128, rope_theta=50000.0, rms_norm_eps=1e-5,
                     partial_rotary_factor=1.0, num_experts=4, num_experts_per_tok=2, moe_layer_freq=[0, 1, 1],
                     qk_layernorm=True, norm_topk_prob=False, moe_router_enable_expert_bias=False,
                     moe_router_score_function="softmax", mask_token_id=297, pad_token_id=2, eos_token_id=0,
                     tie_word_embeddings=False),
}


def _import(folder: Path, package: str) -> None:
    """Import the modeling code in `folder` as package `package` (its modules import each other relatively)."""
    init = folder / "__init__.py"
    if not init.is_file():
        init.touch()
    spec = importlib.util.spec_from_file_location(package, init, submodule_search_locations=[str(folder)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[package] = module
    spec.loader.exec_module(module)


def build(name: str, llada_code: Path, dream_code: Path, lladamoe_code: Path | None = None) -> torch.nn.Module:
    """The reference model `name` (CPU, fp32, eval) with seeded random weights."""
    torch.manual_seed(0)
    if name == "lladamoe":
        assert lladamoe_code is not None, "--lladamoe-code is needed for the lladamoe model"
        _import(lladamoe_code, "ref_lladamoe")
        from ref_lladamoe.configuration_lladamoe import LLaDAMoEConfig  # type: ignore[import-not-found]
        from ref_lladamoe.modeling_lladamoe import LLaDAMoEModelLM  # type: ignore[import-not-found]

        model = LLaDAMoEModelLM(LLaDAMoEConfig(**MODELS[name]))
    elif name.startswith("llada"):
        _import(llada_code, "ref_llada")
        from ref_llada.configuration_llada import LLaDAConfig  # type: ignore[import-not-found]
        from ref_llada.modeling_llada import (  # type: ignore[import-not-found]
            LLaDAModel,
            LLaDAModelLM,
            create_model_config_from_pretrained_config,
        )

        config = LLaDAConfig(**MODELS[name])
        inner = create_model_config_from_pretrained_config(config)
        inner.init_device = "cpu"  # LLaDAModelLM builds on CUDA unless handed a model
        model = LLaDAModelLM(config, model=LLaDAModel(inner, init_params=True))
    else:
        _import(dream_code, "ref_dream")
        from ref_dream.configuration_dream import DreamConfig  # type: ignore[import-not-found]
        from ref_dream.modeling_dream import DreamModel  # type: ignore[import-not-found]

        model = DreamModel(DreamConfig(**MODELS[name]))
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if "norm" in pname else 0.15 * noise)
    return model.float().eval()


def inputs(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [2, 16] (every third position the mask token) and attention_mask [2, 16] (row 1: 4 pads)."""
    g = torch.Generator().manual_seed(1)
    mask_id = MODELS[name]["mask_token_id"]
    ids = torch.randint(3, 290, (BATCH, SEQ), generator=g)
    ids[:, ::3] = mask_id
    attn = torch.ones(BATCH, SEQ, dtype=torch.long)
    attn[1, -4:] = 0
    return ids, attn


@torch.no_grad()
def logits_of(model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor | None) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=attn).logits.float()


def record(out: Path, llada_code: Path, dream_code: Path, names: list[str] | None = None,
           lladamoe_code: Path | None = None) -> None:
    from safetensors.torch import save_file

    for name in names or list(MODELS):
        model = build(name, llada_code, dream_code, lladamoe_code)
        folder = out / name
        model.save_pretrained(str(folder), safe_serialization=True)
        for stale in folder.glob("*.py"):  # the code stays out of the repository
            stale.unlink()
        conf = json.loads((folder / "config.json").read_text())
        conf["auto_map"] = (LLADA_MOE_AUTO_MAP if name == "lladamoe" else LLADA_AUTO_MAP if name.startswith("llada")
                            else DREAM_AUTO_MAP)  # as the released ones
        (folder / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
        ids, attn = inputs(name)
        tensors = {"input_ids": ids, "attention_mask": attn, "logits": logits_of(model, ids, None),
                   "logits_padded": logits_of(model, ids, attn)}
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / f"{name}_reference.safetensors"))
        print(f"{name}: {conf['architectures']} -> {folder}, max |logit| {tensors['logits'].abs().max():.3f}")


def check_export(export: Path, reference: Path, llada_code: Path, dream_code: Path,
                 lladamoe_code: Path | None = None) -> float:
    """Load `export` with the reference class; the largest logit difference to `reference`'s logits."""
    from safetensors.torch import load_file

    conf = json.loads((export / "config.json").read_text())
    arch = conf["architectures"][0]
    name = "dream" if arch == "DreamModel" else "lladamoe" if arch == "LLaDAMoEModelLM" else (
        "llada_sequential" if conf.get("block_type") == "sequential" else "llada_llama")
    model = build(name, llada_code, dream_code, lladamoe_code)
    missing, unexpected = model.load_state_dict(load_file(str(next(export.glob("*.safetensors")))), strict=False)
    tied = {"model.transformer.ff_out.weight", "lm_head.weight"}
    if set(missing) - tied or unexpected:
        raise SystemExit(f"export {export} does not load: missing {missing}, unexpected {unexpected}")
    ref = load_file(str(reference))
    diff = (logits_of(model, ref["input_ids"], None) - ref["logits"]).abs().max().item()
    print(f"{export}: max |dlogit| vs {reference.name} = {diff:.3e}")
    return diff


# Dream's decoding orders on the tiny `dream` model: (name, diffusion_generate arguments, left-padded prompts?)
GEN_CASES = [
    ("origin", dict(alg="origin", steps=6, temperature=0.0), False),
    ("origin_sampled", dict(alg="origin", steps=6, temperature=0.7, top_p=0.95), False),
    ("maskgit_plus", dict(alg="maskgit_plus", steps=5, temperature=0.0), False),
    ("maskgit_plus_alg_temp", dict(alg="maskgit_plus", steps=5, temperature=0.7, alg_temp=0.5), False),
    ("topk_margin", dict(alg="topk_margin", steps=12, temperature=0.0), False),
    ("topk_margin_alg_temp", dict(alg="topk_margin", steps=4, temperature=0.0, alg_temp=0.3), False),
    ("entropy", dict(alg="entropy", steps=5, temperature=0.0), False),
    ("entropy_top_k", dict(alg="entropy", steps=7, temperature=0.5, top_k=20), False),
    ("maskgit_plus_padded", dict(alg="maskgit_plus", steps=6, temperature=0.0), True),
    ("entropy_padded_alg_temp", dict(alg="entropy", steps=6, temperature=0.8, alg_temp=0.4), True),
    # steps = gen_length, Dream's default: step 0 reveals no position but still draws its proposals
    ("maskgit_plus_sampled_all_steps", dict(alg="maskgit_plus", steps=12, temperature=0.7, top_p=0.95), False),
    ("topk_margin_sampled_all_steps", dict(alg="topk_margin", steps=12, temperature=0.7, top_p=0.95), False),
    ("entropy_sampled_all_steps", dict(alg="entropy", steps=12, temperature=0.7, top_p=0.95), False),
]
GEN_LENGTH, PROMPT_LENGTH = 12, 6


def gen_prompts(padded: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """input_ids [2, 6] (no mask tokens) and, when padded, attention_mask [2, 6] with row 1 left-padded by 2."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 290, (BATCH, PROMPT_LENGTH), generator=g)
    if not padded:
        return ids, None
    ids[1, :2] = MODELS["dream"]["pad_token_id"]
    attn = torch.ones(BATCH, PROMPT_LENGTH, dtype=torch.long)
    attn[1, :2] = 0
    return ids, attn


def record_generation(out: Path, dream_code: Path) -> None:
    """Dream's `diffusion_generate` tokens for each of GEN_CASES on the recorded `dream` folder."""
    _import(dream_code, "ref_dream")
    from ref_dream.generation_utils import DreamGenerationConfig  # type: ignore[import-not-found]
    from ref_dream.modeling_dream import DreamModel  # type: ignore[import-not-found]

    model = DreamModel.from_pretrained(str(out / "dream"), torch_dtype=torch.float32).eval()
    cases = []
    for i, (name, kwargs, padded) in enumerate(GEN_CASES):
        ids, attn = gen_prompts(padded)
        seed = 100 + i
        torch.manual_seed(seed)
        # an explicit config: DreamGenerationConfig.from_model_config fails under transformers 4.46.3
        conf = DreamGenerationConfig(max_new_tokens=GEN_LENGTH, mask_token_id=MODELS["dream"]["mask_token_id"],
                                     pad_token_id=MODELS["dream"]["pad_token_id"], eos_token_id=0, bos_token_id=0,
                                     **kwargs)
        seqs = model.diffusion_generate(ids, attention_mask=attn, generation_config=conf)
        cases.append(dict(name=name, kwargs=kwargs, seed=seed, input_ids=ids.tolist(),
                          attention_mask=None if attn is None else attn.tolist(), sequences=seqs.tolist()))
        print(f"{name}: {seqs[:, PROMPT_LENGTH:].tolist()}")
    (out / "dream_generate_reference.json").write_text(json.dumps(dict(gen_length=GEN_LENGTH, cases=cases)) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llada-code", type=Path, default=None, help="folder with configuration_/modeling_llada.py")
    p.add_argument("--dream-code", type=Path, default=None,
                   help="folder with configuration_/modeling_dream.py and generation_utils.py")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--check-export", type=Path, default=None, metavar="DIR",
                   help="load this exported folder with the reference class instead of recording")
    p.add_argument("--reference", type=Path, default=None, help="with --check-export: the _reference file")
    p.add_argument("--lladamoe-code", type=Path, default=None,
                   help="folder with configuration_/modeling_lladamoe.py (for --models lladamoe)")
    p.add_argument("--models", default=None, help="comma-separated names of MODELS to record (default: all)")
    p.add_argument("--generate", action="store_true",
                   help="record Dream's diffusion_generate tokens (needs only --dream-code)")
    a = p.parse_args()
    if a.generate:
        record_generation(a.out, a.dream_code)
        return
    names = a.models.split(",") if a.models else None
    if a.check_export is None and (a.llada_code is None or a.dream_code is None) and names != ["lladamoe"]:
        p.error("--llada-code and --dream-code are required unless --generate or --models lladamoe")
    if a.check_export is not None:
        check_export(a.check_export, a.reference, a.llada_code, a.dream_code, a.lladamoe_code)
    else:
        a.out.mkdir(parents=True, exist_ok=True)
        record(a.out, a.llada_code, a.dream_code, names, a.lladamoe_code)


if __name__ == "__main__":
    main()
