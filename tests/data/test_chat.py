"""Chat rendering: token ids equal to transformers' apply_chat_template, assistant-only loss masks, bad records."""

import gzip
import json

import numpy as np
import pytest

from megadlms.data import load_tokenizer
from megadlms.data.chat import BadRecord, ChatError, ChatRenderer, record_messages
from megadlms.data.indexed import IndexedDataset
from megadlms.data.preprocess import PreprocessError, main, preprocess_jsonl
from megadlms.data.sft import is_chat_dataset, loss_mask_prefix

MULTI = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3."},
         {"role": "assistant", "content": "5"}, {"role": "user", "content": "Reverse abc"},
         {"role": "assistant", "content": "cba"}]


def test_ids_equal_transformers_and_mask_covers_every_assistant_turn(chat_tokenizer_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(chat_tokenizer_dir))
    tok = load_tokenizer(chat_tokenizer_dir)
    renderer = ChatRenderer(tok)
    for msgs in (MULTI, MULTI[1:3]):
        ref = hf.apply_chat_template(msgs, tokenize=True)
        ref = list(ref["input_ids"] if hasattr(ref, "keys") else ref)
        ids, mask = renderer.encode(msgs)
        assert ids == ref
        assert renderer.render_text(msgs) == hf.apply_chat_template(msgs, tokenize=False)
        # the masked tokens are exactly each assistant content plus its end-of-turn
        want = "".join(m["content"] + "<|im_end|>\n" for m in msgs if m["role"] == "assistant")
        assert tok.decode([i for i, m in zip(ids, mask) if m]) == want
    # the generation prompt renders as transformers renders it
    assert renderer.render_text(MULTI[:2], True) == hf.apply_chat_template(MULTI[:2], tokenize=False,
                                                                            add_generation_prompt=True)


def test_prompt_template_for_tokenizers_without_one(tmp_path):
    from .conftest import write_chat_tokenizer

    tok = load_tokenizer(write_chat_tokenizer(tmp_path / "plain", template=None))
    with pytest.raises(ChatError, match="--prompt-template"):
        ChatRenderer(tok)
    with pytest.raises(ChatError, match="placeholder"):
        ChatRenderer(tok, prompt_template="Q: ")
    r = ChatRenderer(tok, prompt_template="Q: {prompt}\nA: ")
    ids, mask = r.encode(record_messages({"prompt": "1+1=", "response": "2"}))
    assert tok.decode(ids) == "Q: 1+1=\nA: 2<|endoftext|>"
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "2<|endoftext|>"
    assert sum(mask) == len(tok.backend.encode("2", add_special_tokens=False).ids) + 1


BAD = [
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ({"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]}, "unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": ["hi"]}, {"role": "assistant", "content": "x"}]},
     "content of type list"),
    ({"prompt": "hi"}, "lacks 'response'"),
    ({"text": "hi"}, "lacks 'messages'"),
    ({"messages": []}, "non-empty list"),
    ([1, 2], "a JSON list"),
]


@pytest.mark.parametrize("record,reason", BAD, ids=[r for _, r in BAD])
def test_every_bad_record_is_named(record, reason):
    with pytest.raises(BadRecord, match=reason):
        record_messages(record)


def test_preprocess_chat_writes_tokens_and_masks_with_the_same_documents(tmp_path, chat_tokenizer_dir, capsys):
    tok = load_tokenizer(chat_tokenizer_dir)
    good = [{"messages": MULTI}, {"prompt": "1+1=", "response": "2"}, {"prompt": "x", "response": "y", "system": "s"}]
    path = tmp_path / "in.jsonl.gz"
    lines = [json.dumps(g) for g in good]
    lines.insert(1, json.dumps({"messages": [{"role": "user", "content": "no answer"}]}))
    lines.insert(3, "{not json")
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    with pytest.raises(PreprocessError, match=r"in\.jsonl\.gz, line 2: has no assistant turn"):
        preprocess_jsonl(path, tmp_path / "out", tok, chat=True, progress=False)
    stats = preprocess_jsonl(path, tmp_path / "out", tok, chat=True, skip_bad_lines=True, progress=False)
    assert stats.documents == 3 and stats.bad_lines == 2
    assert "line 4: not valid JSON" in stats.bad_examples[1]
    prefix = stats.outputs["chat"]
    assert prefix.endswith("out_chat_document") and is_chat_dataset(prefix)
    ids, masks = IndexedDataset(prefix), IndexedDataset(loss_mask_prefix(prefix))
    assert masks.dtype == np.uint8 and ids.num_documents == masks.num_documents == 3
    renderer = ChatRenderer(tok)
    for d, g in enumerate(good):
        want_ids, want_mask = renderer.encode(record_messages(g))
        assert ids.document(d).tolist() == want_ids and masks.document(d).tolist() == want_mask
    # the command line: --chat with a folder input and a one-line error for a template-less tokenizer
    assert main(["--chat", "--input", str(tmp_path), "--output-prefix", str(tmp_path / "cli"), "--tokenizer-model",
                 str(chat_tokenizer_dir), "--skip-bad-lines", "--no-progress"]) == 0
    assert "loss masks" in capsys.readouterr().out


def test_prompts_for_sampling_end_with_the_generation_prompt(chat_tokenizer_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(chat_tokenizer_dir))
    ref = hf.apply_chat_template([{"role": "user", "content": "Reverse abc"}], tokenize=True,
                                 add_generation_prompt=True)
    ref = list(ref["input_ids"] if hasattr(ref, "keys") else ref)
    assert ChatRenderer(load_tokenizer(chat_tokenizer_dir)).encode_prompt("Reverse abc") == ref


def test_preprocess_chat_refuses_a_conversation_holding_the_mask_token(tmp_path, chat_tokenizer_dir):
    tok = load_tokenizer(chat_tokenizer_dir)
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"prompt": "fill <|mask|> in", "response": "ok"}) + "\n"
                    + json.dumps({"prompt": "1+1=", "response": "2"}) + "\n")
    with pytest.raises(PreprocessError, match=rf"in\.jsonl, line 1: the conversation holds the mask token "
                                              rf"'<\|mask\|>' \(id {tok.mask_id}\).*--skip-bad-lines"):
        preprocess_jsonl(path, tmp_path / "out", tok, chat=True, progress=False)
    stats = preprocess_jsonl(path, tmp_path / "out", tok, chat=True, skip_bad_lines=True, progress=False)
    assert stats.documents == 1 and stats.bad_lines == 1
    assert tok.mask_id not in IndexedDataset(stats.outputs["chat"]).document(0).tolist()
