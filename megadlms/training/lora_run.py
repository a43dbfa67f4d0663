"""LoRA runs: which checkpoint is the frozen base, and the reference to it that the adapters' checkpoints keep.

    megadlms train --load BASE --lora-rank 16 --save OUT ...    new adapters on the base BASE
    megadlms train --load OUT  --lora-rank 16 --save OUT ...    resume them on the base OUT records

A LoRA checkpoint holds the adapters, their optimizer state and the run's state (the frozen base is not saved:
the trainer's state dicts leave frozen parameters out). Its meta.json's config records `extra["lora"]` (the
`LoraConfig`) and `extra["lora_base"]` = {"path": the base's iteration folder, "checksum": `base_checksum`}; a
resume or a merge checks that the base it loads has that checksum.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..config import ConfigError, TransformerConfig
from ..lora import LoraConfig
from . import checkpoint as ckpt

if TYPE_CHECKING:
    from ..model import TransformerLM
    from .config import RunConfig


def base_checksum(path: str | Path) -> str:
    """An identity of checkpoint folder `path`'s contents: the CRC-32 of its checksum records (crc32_*.json: the
    size and CRC-32 of every file it holds), cheap for any size of model; of its files themselves where it has
    no records. As 8 hex digits."""
    path = Path(path)
    crc = 0
    records = sorted(path.glob("crc32_*.json"))
    if records:
        for rec in records:
            crc = zlib.crc32(json.dumps(json.loads(rec.read_text()), sort_keys=True).encode(), crc)
    else:
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            crc = zlib.crc32(str(f.relative_to(path)).encode(), crc)
            crc = zlib.crc32(f.read_bytes(), crc)
    return f"{crc:08x}"


def lora_record(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The base reference a LoRA checkpoint's meta records ({"path", "checksum"}), or None for other checkpoints."""
    return meta.get("config", {}).get("extra", {}).get("lora_base")


def resolve_base(record: dict[str, Any], checkpoint: Path, base_path: str | Path | None) -> tuple[Path, str]:
    """(the base's iteration folder, its checksum) for the adapters of `checkpoint`: `base_path` (a folder or a
    save folder), else the recorded path. ConfigError when that base's checksum is not the recorded one."""
    where = base_path if base_path is not None else record["path"]
    base = ckpt.find_checkpoint(where)
    got = base_checksum(base)
    if got != record["checksum"]:
        raise ConfigError(f"the adapters of {checkpoint} were trained on the base {record['path']} (checksum "
                          f"{record['checksum']}), but {base} has checksum {got}: another model, or re-saved since; "
                          "pass --lora-base-path with the base they were trained on")
    return base, got


@dataclass
class LoraPlan:
    """What a LoRA run loads: the adapters' settings, the base checkpoint (an iteration folder) and its checksum,
    and the LoRA checkpoint to resume (None: new adapters on the base)."""

    config: LoraConfig
    base: Path
    checksum: str
    resume: Path | None

    def record(self, cfg: TransformerConfig) -> TransformerConfig:
        """`cfg` with the adapters' settings and the base reference in `extra` (the checkpoints' meta keeps them)."""
        ref = {"path": str(self.base.resolve()), "checksum": self.checksum}
        return cfg.replace(extra={**cfg.extra, "lora": self.config.to_dict(), "lora_base": ref})

    def load_base(self, model: TransformerLM) -> None:
        """Write the base's weights into the plain model (before the FP8 conversion and LoRA; collective)."""
        load_plain_weights(model, self.base)


def load_plain_weights(model: TransformerLM, path: Path) -> None:
    """The weights of checkpoint folder `path` into the plain (unconverted) `model`, in place."""
    state = {"model": model.state_dict()}
    ckpt.load_model_state(path, state)
    model.load_state_dict(state["model"])


def plan_lora(config: RunConfig, compute_dtype: torch.dtype | None) -> LoraPlan | None:
    """The LoraPlan of a run (None without --lora-rank): `--load` names the base, or a LoRA checkpoint to resume,
    whose recorded base (or --lora-base-path) must have the recorded checksum."""
    if not config.lora.enabled:
        return None
    lora = config.lora.lora_config(config.fp8.fp8_format, compute_dtype)
    ck = config.checkpoint
    assert ck.load is not None  # RunConfig requires --load with LoRA
    path = ckpt.find_checkpoint(ck.load, ck.ckpt_step)
    record = lora_record(ckpt.read_meta(path))
    if record is None:
        if config.lora.lora_base_path is not None:
            raise ConfigError(f"--lora-base-path {config.lora.lora_base_path}: --load {ck.load} is a base, not a LoRA "
                              "checkpoint to resume; drop --lora-base-path")
        return LoraPlan(lora, path, base_checksum(path), resume=None)
    if ck.finetune:
        raise ConfigError(f"--finetune with the LoRA checkpoint {path}: to go on training its adapters drop "
                          "--finetune; for new adapters --load the base it records")
    base, checksum = resolve_base(record, path, config.lora.lora_base_path)
    return LoraPlan(lora, base, checksum, resume=path)


def load_lora_model(load_dir: str | Path, *, iteration: int | None = None, base_path: str | Path | None = None,
                    device: torch.device | str = "cpu") -> tuple[TransformerLM, TransformerConfig, LoraConfig, dict]:
    """The model of a LoRA checkpoint (single process): its base, checked against the recorded checksum, in the
    precision it was saved in, with the adapters loaded on it (`LoraConfig.base` "keep": the exact base).

    Returns (model, the base's config without the LoRA records, the LoraConfig, meta)."""
    from ..build import construct_model
    from ..lora import adapter_state_dict, apply_lora

    path = ckpt.find_checkpoint(load_dir, iteration)
    meta = ckpt.read_meta(path)
    record = lora_record(meta)
    if record is None:
        raise ckpt.CheckpointError(f"{path} is not a LoRA checkpoint (its config records no base); merge or export "
                                   "the adapters of a run trained with --lora-rank")
    base, _ = resolve_base(record, path, base_path)
    extra = dict(meta["config"].get("extra", {}))
    lora = LoraConfig.from_dict({**extra.pop("lora"), "base": "keep"})
    extra.pop("lora_base")
    cfg = TransformerConfig.from_dict({**meta["config"], "extra": extra, "fp8": False})
    model = construct_model(cfg, device=device)
    load_plain_weights(model, base)
    apply_lora(model, lora)
    ckpt.load_model_state(path, {"model": {k: v.detach() for k, v in adapter_state_dict(model).items()}})  # in place
    tok = path / "tokenizer"
    meta["tokenizer_dir"] = str(tok) if tok.is_dir() else None
    meta["path"], meta["base"] = str(path), str(base)
    return model, cfg, lora, meta
