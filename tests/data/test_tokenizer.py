"""The tokenizer wrapper and the bundled tokenizer."""

from __future__ import annotations

import gzip
import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from megadlms.data.preprocess import BUNDLED_CORPUS
from megadlms.data.tokenizer import (
    EOD_TOKEN,
    Tokenizer,
    TokenizerError,
    check_tokenizer_type,
    default_tokenizer_path,
    load_tokenizer,
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def corpus_texts():
    with gzip.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for _, line in zip(range(600), f)]


def test_bundled_ids(tok):
    assert tok.vocab_size == 4096
    assert (tok.eod_id, tok.mask_id, tok.pad_id) == (0, 1, 2)
    assert tok.decode([tok.eod_id, tok.mask_id, tok.pad_id]) == "<|endoftext|><|mask|><|pad|>"
    assert tok.source_dir == default_tokenizer_path()


def test_round_trip_and_compression(tok, corpus_texts):
    n_bytes = n_tokens = 0
    for t in corpus_texts:
        ids = tok.encode(t)
        assert tok.decode(ids) == t
        n_bytes += len(t.encode())
        n_tokens += len(ids)
    # a 4096-token BPE trained on this corpus packs well over 3 bytes per token
    assert n_bytes / n_tokens > 3.5
    s = "Über naïve café, 漢字 and emoji 🙂 survive byte-level BPE.\n\tTabs  and  spaces  "
    assert tok.decode(tok.encode(s)) == s


def test_word_cache_is_exact(tok, corpus_texts):
    assert tok._word_cache is not None
    for t in corpus_texts[:200]:
        assert tok.encode(t) == tok.backend.encode(t).ids
    r = random.Random(0)
    pieces = [" ", "  ", "a", "The", "é", "\n", "\n\n", "\t", "<|mask|>", "<|endoftext|>", ".", "漢", "\u00a0", "3",
              " 42", "!", "'s"]
    for _ in range(3000):
        s = "".join(r.choice(pieces) for _ in range(r.randint(0, 14)))
        assert tok.encode(s) == tok.backend.encode(s).ids, repr(s)
    assert tok.encode_batch(corpus_texts[:20]) == [e.ids for e in tok.backend.encode_batch(corpus_texts[:20])]


def test_special_tokens_in_text_are_single_ids(tok):
    ids = tok.encode("a cat<|mask|> sat<|endoftext|>")
    assert tok.mask_id in ids and ids[-1] == tok.eod_id


def test_matches_transformers_auto_tokenizer(tok, corpus_texts):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(default_tokenizer_path()))
    assert (hf.eos_token_id, hf.mask_token_id, hf.pad_token_id) == (0, 1, 2)
    assert len(hf) == 4096
    for t in corpus_texts[:50]:
        assert hf(t)["input_ids"] == tok.encode(t)


def test_save_and_reload(tok, tmp_path):
    tok.save(tmp_path / "saved")
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == [
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    again = load_tokenizer(tmp_path / "saved")
    assert (again.vocab_size, again.eod_id, again.mask_id, again.pad_id) == (4096, 0, 1, 2)
    assert again.fingerprint == tok.fingerprint
    also = load_tokenizer(tmp_path / "saved" / "tokenizer.json")
    assert also.source_dir == tmp_path / "saved"


def _gpt2_style(tmp_path, specials, config=None):
    t = HFTokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(["hello world"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tmp_path.mkdir(parents=True, exist_ok=True)
    t.save(str(tmp_path / "tokenizer.json"))
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_special_tokens_from_config_and_known_names(tmp_path):
    d = _gpt2_style(tmp_path / "a", ["<s>", "</s>", "<mask>", "<pad>"])
    t = load_tokenizer(d)
    assert (t.eod_token, t.mask_token, t.pad_token) == ("</s>", "<mask>", "<pad>")
    assert t._word_cache is None  # GPT-2 regex pre-tokenizer: the plain library path
    assert t.decode(t.encode("hello world")) == "hello world"
    d = _gpt2_style(tmp_path / "b", ["<s>", "</s>", "<|mdm_mask|>"],
                    {"eos_token": {"content": "<s>", "special": True}})
    t = load_tokenizer(d)
    assert t.eod_token == "<s>" and t.mask_token == "<|mdm_mask|>" and t.pad_id is None


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer not found at .*nowhere"):
        load_tokenizer(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="the folder has no tokenizer.json"):
        load_tokenizer(tmp_path / "empty")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot load tokenizer .*broken.json"):
        load_tokenizer(tmp_path / "broken.json")
    d = _gpt2_style(tmp_path / "noeod", ["<s>"])
    with pytest.raises(TokenizerError, match="no end-of-document token"):
        load_tokenizer(d)
    with pytest.raises(TokenizerError, match="'<nope>' is not in the tokenizer vocabulary"):
        Tokenizer.from_file(d, eod_token="<nope>")
    with pytest.raises(TokenizerError, match="GPT2BPETokenizer.* is not supported; use HuggingFaceTokenizer"):
        check_tokenizer_type("GPT2BPETokenizer")
    assert Tokenizer.from_file(default_tokenizer_path(), eod_token=EOD_TOKEN).eod_id == 0
