"""LLaDA's tensor names (`LLaDAModelLM`, OLMo style, under `model.transformer`) <-> ours.

    model.transformer.wte                     embed_tokens
    model.transformer.blocks.N.attn_norm      layers.N.input_layernorm
    model.transformer.blocks.N.{q,k,v}_proj   layers.N.self_attn.{q,k,v}_proj        (block type llama)
    model.transformer.blocks.N.att_proj       [q_proj; k_proj; v_proj] rows           (block type sequential)
    model.transformer.blocks.N.attn_out       layers.N.self_attn.o_proj
    model.transformer.blocks.N.ff_norm        layers.N.post_attention_layernorm
    model.transformer.blocks.N.ff_proj        layers.N.mlp.gate_proj                  (llama)
    model.transformer.blocks.N.up_proj        layers.N.mlp.up_proj                    (llama)
    model.transformer.blocks.N.ff_proj        [up_proj; gate_proj] rows               (sequential)
    model.transformer.blocks.N.ff_out         layers.N.mlp.down_proj
    model.transformer.ln_f                    norm
    model.transformer.ff_out                  lm_head (absent when weight_tying)

A fused tensor is split along its rows (dim 0), its bias too; the pieces are views of the loaded tensor.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..config import TransformerConfig
from ..dlm_formats import LLADA_ARCHITECTURE, dlm_format, llada_block_type
from ..presets import hf_architecture

PREFIX = "model.transformer."

_TOP = {"wte.weight": "embed_tokens.weight", "ln_f.weight": "norm.weight", "ff_out.weight": "lm_head.weight"}
_LLAMA_BLOCK = {"attn_norm": ("input_layernorm",), "q_proj": ("self_attn.q_proj",), "k_proj": ("self_attn.k_proj",),
                "v_proj": ("self_attn.v_proj",), "attn_out": ("self_attn.o_proj",),
                "ff_norm": ("post_attention_layernorm",), "ff_proj": ("mlp.gate_proj",), "up_proj": ("mlp.up_proj",),
                "ff_out": ("mlp.down_proj",)}
_SEQUENTIAL_BLOCK = {"attn_norm": ("input_layernorm",),
                     "att_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                     "attn_out": ("self_attn.o_proj",), "ff_norm": ("post_attention_layernorm",),
                     "ff_proj": ("mlp.up_proj", "mlp.gate_proj"), "ff_out": ("mlp.down_proj",)}


def is_llada(cfg: TransformerConfig, hf_format: str = "auto") -> bool:
    """Whether `cfg` is exported (or was imported) in LLaDA's format."""
    return hf_architecture(cfg, hf_format) == LLADA_ARCHITECTURE


def cfg_block_type(cfg: TransformerConfig) -> str:
    """The LLaDA block type of `cfg`: the imported config.json's, else 'llama' (LLaDA-8B's)."""
    source = (cfg.extra or {}).get("hf_config")
    return llada_block_type(source) if source is not None and dlm_format(source) == "llada" else "llama"


def layout(our_names: list[str], block_type: str) -> dict[str, tuple[str, ...]]:
    """LLaDA name -> the names of ours whose rows it holds, in order, for the state dict names `our_names`."""
    block = _LLAMA_BLOCK if block_type == "llama" else _SEQUENTIAL_BLOCK
    to_llada: dict[str, tuple[str, str]] = {}  # our module path -> (LLaDA module path, parameter suffix)
    for llada_mod, ours in block.items():
        for our_mod in ours:
            to_llada[our_mod] = (llada_mod, "")
    out: dict[str, list[str]] = {}
    for name in our_names:
        if name in _TOP.values():
            llada = PREFIX + next(k for k, v in _TOP.items() if v == name)
        else:
            _, n, rest = name.split(".", 2)  # layers.N.<module>.<param>
            module, param = rest.rsplit(".", 1)
            llada = f"{PREFIX}blocks.{n}.{to_llada[module][0]}.{param}"
        out.setdefault(llada, []).append(name)
    # order the pieces of fused tensors as LLaDA concatenates them
    order = {m: i for ours in block.values() for i, m in enumerate(ours)}
    return {k: tuple(sorted(v, key=lambda n: order.get(n.split(".", 2)[-1].rsplit(".", 1)[0], 0)))
            for k, v in out.items()}


def expected_shapes(ours: Mapping[str, tuple[int, ...]], block_type: str) -> dict[str, tuple[int, ...]]:
    """LLaDA name -> shape, from our names -> shapes (fused tensors: the row counts summed)."""
    out: dict[str, tuple[int, ...]] = {}
    for llada, names in layout(list(ours), block_type).items():
        first = ours[names[0]]
        out[llada] = (sum(ours[n][0] for n in names), *first[1:])
    return out


def to_ours(tensors: Mapping[str, torch.Tensor], ours: Mapping[str, tuple[int, ...]],
            block_type: str) -> dict[str, torch.Tensor]:
    """LLaDA tensors (names and shapes already checked against `expected_shapes`) -> ours, fused ones split."""
    out: dict[str, torch.Tensor] = {}
    for llada, names in layout(list(ours), block_type).items():
        t = tensors[llada]
        pieces = t.split([ours[n][0] for n in names], dim=0) if len(names) > 1 else (t,)
        out.update(zip(names, pieces))
    return out


def from_ours(state_dict: Mapping[str, torch.Tensor], block_type: str) -> dict[str, torch.Tensor]:
    """Our tensors (names and shapes already checked) -> LLaDA's names, fused ones concatenated."""
    out = {}
    for llada, names in layout(list(state_dict), block_type).items():
        out[llada] = state_dict[names[0]] if len(names) == 1 else torch.cat([state_dict[n] for n in names])
    return out
