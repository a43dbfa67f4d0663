"""Tokenizer: a thin wrapper over a Hugging Face `tokenizers` tokenizer.json with the ids a DLM needs.

The special ids are resolved in this order: explicit arguments, `tokenizer_config.json`,
`special_tokens_map.json`, then well-known token strings present in the vocabulary. The end-of-document
(EOD) id is required: it separates documents in the packed training stream. The mask id is the diffusion
[MASK] token; a tokenizer without one can still be used for autoregressive training or with an explicit
`--mask-token` id.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _Backend

from ..errors import MegaDLMsError

EOD_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
PAD_TOKEN = "<|pad|>"

# Known spellings, most specific first (Qwen/GPT-2, Llama 3, Llama 2/Mistral, Gemma, BERT; LLaDA's mask).
_EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "[SEP]")
_MASK_CANDIDATES = (MASK_TOKEN, "<|mdm_mask|>", "<mask>", "[MASK]", "<|MASK|>")
_PAD_CANDIDATES = (PAD_TOKEN, "<pad>", "[PAD]", "<|finetune_right_pad_id|>")

SUPPORTED_TOKENIZER_TYPES = ("HuggingFaceTokenizer",)
ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"


class TokenizerError(MegaDLMsError, ValueError):
    """A tokenizer file or setting is invalid; the message says which and how to fix it."""


def default_tokenizer_path() -> Path:
    """The folder of the bundled byte-level BPE tokenizer (vocab 4096, EOD 0, mask 1, pad 2)."""
    return ASSETS_DIR / "tokenizer"


def check_tokenizer_type(tokenizer_type: str | None) -> None:
    """Refuse Megatron tokenizer types other than HuggingFaceTokenizer with a message saying what to use."""
    if tokenizer_type is not None and tokenizer_type not in SUPPORTED_TOKENIZER_TYPES:
        raise TokenizerError(
            f"--tokenizer-type {tokenizer_type!r} is not supported; use HuggingFaceTokenizer with "
            "--tokenizer-model pointing at a tokenizer.json (or a folder holding one). GPT-2 vocab/merges and "
            "SentencePiece models can be converted to tokenizer.json with transformers "
            "(AutoTokenizer.from_pretrained(...).save_pretrained(folder)).")


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens either as a string or as an AddedToken dict.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise TokenizerError(f"cannot parse {path}: {e}; fix or delete the file") from e
    return data if isinstance(data, dict) else {}


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the EOD / mask / pad ids; see `load_tokenizer`."""

    def __init__(self, backend: _Backend, *, eod_token: str, mask_token: str | None = None,
                 pad_token: str | None = None, source_dir: str | os.PathLike | None = None) -> None:
        self.backend = backend
        self.eod_token, self.mask_token, self.pad_token = eod_token, mask_token, pad_token
        self.eod_id = self._id_of(eod_token, "eod_token")
        self.mask_id = None if mask_token is None else self._id_of(mask_token, "mask_token")
        self.pad_id = None if pad_token is None else self._id_of(pad_token, "pad_token")
        self._source_dir = Path(source_dir) if source_dir is not None else None
        self._word_cache: dict[str, list[int]] | None = {} if _word_cacheable(backend) else None
        self._added = [t.content for t in backend.get_added_tokens_decoder().values()]

    def _id_of(self, token: str, what: str) -> int:
        i = self.backend.token_to_id(token)
        if i is None:
            raise TokenizerError(f"{what} {token!r} is not in the tokenizer vocabulary; pass a token string that "
                                 "exists in tokenizer.json (or add it as a special token)")
        return int(i)

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, eod_token: str | None = None, mask_token: str | None = None,
                  pad_token: str | None = None) -> Tokenizer:
        """Load `path` (a tokenizer.json, or a folder holding one) and resolve the special tokens."""
        p = Path(path).expanduser()
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            hint = " (the folder has no tokenizer.json)" if p.is_dir() else ""
            raise TokenizerError(f"tokenizer not found at {str(p)!r}{hint}; pass a tokenizer.json file or a folder "
                                 "holding one (Hugging Face hub names are not fetched: download the folder first)")
        try:
            backend = _Backend.from_file(str(file))
        except Exception as e:  # the Rust side raises a bare Exception on malformed JSON
            raise TokenizerError(f"cannot load tokenizer {str(file)!r}: {e}") from e
        folder = file.parent
        cfg, smap = _read_json(folder / "tokenizer_config.json"), _read_json(folder / "special_tokens_map.json")
        vocab = backend.get_vocab(with_added_tokens=True)

        def resolve(explicit: str | None, key: str, candidates: tuple[str, ...]) -> str | None:
            if explicit is not None:
                return explicit
            for source in (cfg, smap):
                tok = _token_content(source.get(key))
                if tok is not None and tok in vocab:
                    return tok
            return next((c for c in candidates if c in vocab), None)

        eod = resolve(eod_token, "eos_token", _EOD_CANDIDATES)
        if eod is None:
            raise TokenizerError(f"no end-of-document token found for {str(file)!r}: tokenizer_config.json has no "
                                 f"eos_token and none of {list(_EOD_CANDIDATES)} is in the vocabulary; pass "
                                 "eod_token=... naming the token that ends a document")
        return cls(backend, eod_token=eod, mask_token=resolve(mask_token, "mask_token", _MASK_CANDIDATES),
                   pad_token=resolve(pad_token, "pad_token", _PAD_CANDIDATES), source_dir=folder)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added special tokens included (the embedding needs at least this many rows)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def source_dir(self) -> Path | None:
        """The folder holding the tokenizer's files (None for one built in memory and never saved)."""
        return self._source_dir

    @property
    def fingerprint(self) -> str:
        """sha256 of the serialized tokenizer and its special tokens: equal fingerprints tokenize identically."""
        h = hashlib.sha256(self.backend.to_str().encode("utf-8"))
        h.update(f"|{self.eod_token}|{self.mask_token}|{self.pad_token}".encode())
        return h.hexdigest()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with the tokenizer's own post-processing (e.g. a BOS token for Llama)."""
        if self._word_cache is not None and not any(a in text for a in self._added):
            return self._encode_words(text)
        return self.backend.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text (the Rust tokenizer's batch call when the word cache does not apply)."""
        if self._word_cache is not None:
            return [self.encode(t) for t in texts]
        return [e.ids for e in self.backend.encode_batch_fast(texts)]

    def _encode_words(self, text: str) -> list[int]:
        # The pre-tokenizer splits at each " " and glues the space to the following piece; pieces are then
        # encoded independently by the model, so ids per piece can be cached (exact, see _word_cacheable).
        cache = self._word_cache
        assert cache is not None  # called only when the word cache is on
        if len(cache) > _WORD_CACHE_LIMIT:
            cache.clear()
        out: list[int] = []
        parts = text.split(" ")
        head = parts[0]
        if head:
            ids = cache.get(head)
            if ids is None:
                ids = cache[head] = self.backend.encode(head).ids
            out.extend(ids)
        for p in parts[1:]:
            w = " " + p
            ids = cache.get(w)
            if ids is None:
                ids = cache[w] = self.backend.encode(w).ids
            out.extend(ids)
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; mask and EOD tokens are shown unless `skip_special_tokens`."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def special_tokens(self) -> dict[str, str]:
        """The resolved special tokens under transformers' names: eos_token, and pad_token / mask_token if any."""
        special = {"eos_token": self.eod_token}
        if self.pad_token is not None:
            special["pad_token"] = self.pad_token
        if self.mask_token is not None:
            special["mask_token"] = self.mask_token
        return special

    def hf_config(self) -> dict[str, Any]:
        """tokenizer_config.json for this tokenizer: the fast class over tokenizer.json as it is (its own
        pre-tokenizer, not one a model type implies), no text clean-up, and the special tokens."""
        return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30,
                "clean_up_tokenization_spaces": False, "bos_token": None, "unk_token": None,
                **self.special_tokens()}

    def save(self, directory: str | os.PathLike) -> None:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json (loadable by
        `transformers.AutoTokenizer.from_pretrained(directory)` and by `load_tokenizer(directory)`)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(d / "tokenizer.json"))
        special = self.special_tokens()
        config = self.hf_config()
        (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        (d / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")
        if self._source_dir is None:
            self._source_dir = d

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, eod_id={self.eod_id}, mask_id={self.mask_id}, "
                f"pad_id={self.pad_id}, source_dir={str(self._source_dir)!r})")


_WORD_CACHE_LIMIT = 1 << 20


def complete_tokenizer_config(folder: str | os.PathLike, *, mask_id: int | None = None) -> bool:
    """Make `folder`'s tokenizer.json load in transformers as it loads here; returns True when a file was written.

    A folder without tokenizer_config.json (a run given a bare tokenizer.json) gets one (`Tokenizer.hf_config`):
    without it `AutoTokenizer` picks a class from the model type, whose pre-tokenizer may split differently. A
    folder that has one keeps it, with the special tokens it lacks added. The special tokens are those
    `load_tokenizer(folder)` resolves, as training did; `mask_id` (the model's [MASK] id) names the mask token
    when its id is in the vocabulary. Folders without tokenizer.json, or whose tokenizer has no EOD, are left alone.
    """
    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
        return False
    try:
        tok = Tokenizer.from_file(folder)
    except TokenizerError:  # no EOD: nothing this module could name; transformers' own defaults stay
        return False
    special = tok.special_tokens()
    mask = None if mask_id is None else tok.backend.id_to_token(mask_id)
    if mask is not None:
        special["mask_token"] = mask
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        path.write_text(json.dumps({**tok.hf_config(), **special}, indent=2) + "\n", encoding="utf-8")
        return True
    config = _read_json(path)
    missing = {k: v for k, v in special.items() if _token_content(config.get(k)) is None}
    if not missing:
        return False
    path.write_text(json.dumps({**config, **missing}, indent=2) + "\n", encoding="utf-8")
    return True


def _word_cacheable(backend: _Backend) -> bool:
    """True when ids can be cached per space-separated piece with results identical to `backend.encode`:
    no normalizer, pre-tokenizer = [Split(" ", merged_with_next), ByteLevel(use_regex=False)], a
    deterministic model (no BPE dropout), and a post-processor that adds no tokens (None or ByteLevel)."""
    spec = json.loads(backend.to_str())
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if spec.get("normalizer") is not None or not steps or len(steps) != 2:
        return False
    split, byte_level = steps
    ok_split = (split.get("type") == "Split" and split.get("pattern") == {"String": " "}
                and split.get("behavior") == "MergedWithNext" and not split.get("invert", False))
    ok_bl = byte_level.get("type") == "ByteLevel" and byte_level.get("use_regex") is False \
        and not byte_level.get("add_prefix_space", False)
    post = spec.get("post_processor")
    ok_post = post is None or post.get("type") == "ByteLevel"
    model = spec.get("model") or {}
    ok_model = model.get("dropout") is None
    no_extras = spec.get("truncation") is None and spec.get("padding") is None
    return ok_split and ok_bl and ok_post and ok_model and no_extras


def load_tokenizer(path: str | os.PathLike | None = None, *, tokenizer_type: str | None = None) -> Tokenizer:
    """Load a tokenizer: `None` -> the bundled one; else a tokenizer.json or a folder holding one.

    `tokenizer_type` is Megatron's --tokenizer-type; only HuggingFaceTokenizer (or None) is accepted.
    """
    check_tokenizer_type(tokenizer_type)
    return Tokenizer.from_file(default_tokenizer_path() if path is None else path)
