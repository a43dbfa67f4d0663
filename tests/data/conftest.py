"""Shared fixtures of the data tests: synthetic corpora whose tokens say where they came from."""

from __future__ import annotations

import numpy as np
import pytest

from megadlms.data.indexed import IndexedDatasetBuilder

STRIDE = 1000  # token = base + document * STRIDE + position (positions < STRIDE)


def doc_tokens(doc: int, length: int, base: int = 0) -> np.ndarray:
    return base + doc * STRIDE + np.arange(length, dtype=np.int64)


@pytest.fixture
def make_corpus(tmp_path):
    """make_corpus(name, lengths, base=0) -> prefix of an int32 dataset; document d has lengths[d] tokens
    base + d*STRIDE + [0, 1, ...]."""

    def make(name: str, lengths, base: int = 0) -> str:
        prefix = str(tmp_path / name)
        with IndexedDatasetBuilder(prefix, np.int32) as b:
            for d, n in enumerate(lengths):
                b.add_document(doc_tokens(d, int(n), base))
        return prefix

    return make


CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def write_chat_tokenizer(folder, template: str | None = CHAT_TEMPLATE):
    """The bundled BPE plus <|im_start|> / <|im_end|>, saved by transformers with `template` as its chat
    template (None: no template)."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    from megadlms.data.tokenizer import default_tokenizer_path

    t = Tokenizer.from_file(str(default_tokenizer_path() / "tokenizer.json"))
    t.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    fast = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                   mask_token="<|mask|>")
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def chat_tokenizer_dir(tmp_path_factory):
    return write_chat_tokenizer(tmp_path_factory.mktemp("chat_tok"))
