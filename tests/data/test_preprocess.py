"""`megadlms preprocess`: jsonl -> indexed datasets; worker-count independence; bad-input reporting."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from megadlms.data import preprocess as pp
from megadlms.data.indexed import IndexedDataset
from megadlms.data.tokenizer import Tokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def texts():
    with gzip.open(pp.BUNDLED_CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for _, line in zip(range(400), f)]


@pytest.fixture
def small_chunks(monkeypatch):
    # Many small chunks so two workers really interleave.
    monkeypatch.setattr(pp, "CHUNK_LINES", 7)


def write_jsonl(path: Path, rows: list, gz: bool = False) -> Path:
    data = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def outputs(prefix: str) -> tuple[bytes, bytes]:
    return Path(prefix + ".bin").read_bytes(), Path(prefix + ".idx").read_bytes()


def test_workers_give_identical_output(tmp_path, tok, texts, small_chunks):
    rows = [{"text": t, "title": t.split(".")[0]} for t in texts]
    rows[5]["text"] = ""  # an empty document
    rows[9]["text"] = ["First sentence.", "", "Second one."]  # a document of sequences
    write_jsonl(tmp_path / "in" / "a.jsonl", rows[:250])
    write_jsonl(tmp_path / "in" / "b.jsonl.gz", rows[250:], gz=True)
    results = {}
    for w in (1, 2):
        st = pp.preprocess_jsonl(tmp_path / "in", tmp_path / f"out{w}" / "c", tok, json_keys=["text", "title"],
                           append_eod=True, workers=w, progress=False)
        assert st.documents == 400 and st.bad_lines == 0
        results[w] = {k: outputs(p) for k, p in st.outputs.items()}
    assert results[1] == results[2]
    assert sorted(os.listdir(tmp_path / "out1")) == ["c_text_document.bin", "c_text_document.idx",
                                                    "c_title_document.bin", "c_title_document.idx"]


def test_tokens_equal_tokenizer_plus_eod(tmp_path, tok, texts):
    rows = [{"text": t} for t in texts[:50]] + [{"text": ""}, {"text": ["A cat.", "", "A dog."]}]
    write_jsonl(tmp_path / "x.jsonl", rows)
    st = pp.preprocess_jsonl(tmp_path / "x.jsonl", tmp_path / "o", tok, append_eod=True, progress=False)
    ds = IndexedDataset(st.outputs["text"])
    assert ds.dtype == np.uint16 and ds.num_documents == 52
    for i, t in enumerate(texts[:50]):
        assert ds.document(i).tolist() == tok.encode(t) + [tok.eod_id]
    assert ds.document_lengths[50] == 0  # empty text: a document without sequences (Megatron's behaviour)
    a, b = tok.encode("A cat."), tok.encode("A dog.")
    assert [ds[i].tolist() for i in range(ds.document_indices[51], ds.document_indices[52])] == [a, b + [0]]
    assert st.tokens["text"] == ds.num_tokens
    st2 = pp.preprocess_jsonl(tmp_path / "x.jsonl", tmp_path / "noeod", tok, progress=False)
    assert IndexedDataset(st2.outputs["text"]).document(0).tolist() == tok.encode(texts[0])


def test_large_vocab_uses_int32(tmp_path):
    vocab = {f"w{i}": i for i in range(70_000)}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(["<|endoftext|>"])
    big = Tokenizer(backend, eod_token="<|endoftext|>")
    write_jsonl(tmp_path / "big.jsonl", [{"text": "w69999 w3 w65535"}])
    st = pp.preprocess_jsonl(tmp_path / "big.jsonl", tmp_path / "big", big, append_eod=True, progress=False)
    ds = IndexedDataset(st.outputs["text"])
    assert ds.dtype == np.int32
    assert ds[0].tolist() == [69999, 3, 65535, 70000]


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("line, message", [
    ('{"text": "ok"', r"not valid JSON \(Expecting ',' delimiter at column 14\)"),
    ('{"body": "no text key"}', r"lacks the key 'text' \(present keys: \['body'\]\)"),
    ('{"text": 42}', r"has 'text' of type int"),
    ('[1, 2]', r"a JSON list, expected an object"),
    (b'{"text": "caf\xe9"}', r"not valid UTF-8 \(byte 13"),
    # the [MASK] token spelled out in the text: diffusion training could not use the document
    ('{"text": "a <|mask|> in the text"}', r"its 'text' holds the mask token '<\|mask\|>' \(id 1\), which a "
                                           r"masked-diffusion model cannot be trained on"),
])
def test_bad_line_names_file_and_line(tmp_path, tok, line, message, workers, small_chunks):
    good = [json.dumps({"text": f"Line {i}."}) for i in range(20)]
    raw = b"\n".join([g.encode() for g in good[:16]] + [line if isinstance(line, bytes) else line.encode()]
                     + [g.encode() for g in good[16:]]) + b"\n"
    (tmp_path / "in.jsonl").write_bytes(raw)
    with pytest.raises(pp.PreprocessError, match=rf"in\.jsonl, line 17: {message}.*--skip-bad-lines"):
        pp.preprocess_jsonl(tmp_path / "in.jsonl", tmp_path / "out" / "o", tok, workers=workers, progress=False)
    # nothing that looks like output is left behind, not even temporary files
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []
    st = pp.preprocess_jsonl(tmp_path / "in.jsonl", tmp_path / "out" / "o", tok, workers=workers,
                       skip_bad_lines=True, progress=False)
    assert st.bad_lines == 1 and st.documents == 20 and "line 17" in st.bad_examples[0]
    assert IndexedDataset(st.outputs["text"]).num_documents == 20


def test_blank_lines_are_skipped_and_line_numbers_stay_true(tmp_path, tok):
    (tmp_path / "b.jsonl").write_text('{"text": "a"}\n\n   \n{"text": "b"}\nnope\n')
    with pytest.raises(pp.PreprocessError, match=r"b\.jsonl, line 5: not valid JSON"):
        pp.preprocess_jsonl(tmp_path / "b.jsonl", tmp_path / "o", tok, progress=False)


def test_corrupt_gzip_names_file(tmp_path, tok):
    good = gzip.compress(b'{"text": "hello"}\n' * 1000)
    (tmp_path / "t.jsonl.gz").write_bytes(good[: len(good) // 2])
    with pytest.raises(pp.PreprocessError, match=r"cannot read .*t\.jsonl\.gz"):
        pp.preprocess_jsonl(tmp_path / "t.jsonl.gz", tmp_path / "o", tok, progress=False)
    assert not any(p.name.startswith("o_") for p in tmp_path.iterdir())


def test_resolve_inputs(tmp_path):
    a = write_jsonl(tmp_path / "d" / "b.jsonl", [{"text": "x"}])
    b = write_jsonl(tmp_path / "d" / "a.jsonl.gz", [{"text": "y"}], gz=True)
    (tmp_path / "d" / "notes.txt").write_text("ignored")
    assert pp.resolve_inputs(tmp_path / "d") == [b, a]
    assert pp.resolve_inputs(str(tmp_path / "d" / "*.jsonl*")) == [b, a]
    assert pp.resolve_inputs([str(a)]) == [a]
    with pytest.raises(pp.PreprocessError, match=r"--input '.*missing\.jsonl' does not exist"):
        pp.resolve_inputs(tmp_path / "missing.jsonl")
    with pytest.raises(pp.PreprocessError, match="matches no files"):
        pp.resolve_inputs(str(tmp_path / "*.parquet"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(pp.PreprocessError, match="holds no"):
        pp.resolve_inputs(tmp_path / "empty")


def test_cli_run(tmp_path, capsys, texts):
    write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts[:30]])
    parser = argparse.ArgumentParser()
    pp.add_arguments(parser)
    args = parser.parse_args(["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "o"),
                              "--append-eod", "--workers", "2", "--no-progress"])
    assert pp.run(args) == 0
    out = capsys.readouterr().out
    assert "30 documents" in out and "o_text_document.bin" in out
    assert IndexedDataset(tmp_path / "o_text_document").num_documents == 30
    args.no_progress, args.output_prefix = False, str(tmp_path / "o2")
    assert pp.run(args) == 0 and "preprocess:" not in capsys.readouterr().err  # stderr is no terminal: no bar
    # bad input: one line on stderr, exit status 2
    assert pp.main(["--input", str(tmp_path / "nope.jsonl"), "--output-prefix", str(tmp_path / "p")]) == 2
    assert capsys.readouterr().err.startswith("megadlms preprocess: error: --input")
    assert pp.main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "q"),
                    "--tokenizer-type", "SentencePieceTokenizer"]) == 2
    assert "use HuggingFaceTokenizer" in capsys.readouterr().err


def test_megatron_style_script(tmp_path, monkeypatch, texts):
    write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts[:10]])
    monkeypatch.setattr(sys, "argv", ["preprocess_data.py", "--input", str(tmp_path / "in.jsonl"),
                                      "--output-prefix", str(tmp_path / "m"), "--tokenizer-type",
                                      "HuggingFaceTokenizer", "--tokenizer-model",
                                      str(ROOT / "megadlms" / "assets" / "tokenizer"), "--append-eod",
                                      "--workers", "1", "--no-progress"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "tools" / "preprocess_data.py"), run_name="__main__")
    assert e.value.code == 0
    assert IndexedDataset(tmp_path / "m_text_document").num_documents == 10


def test_bundled_dataset_is_cached(tmp_path, tok, monkeypatch):
    calls = []
    real = pp.preprocess_jsonl

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(pp, "preprocess_jsonl", counting)
    first = pp.bundled_dataset(tok, tmp_path, progress=False)
    second = pp.bundled_dataset(tok, tmp_path, progress=False)
    assert first == second and len(calls) == 1
    ds = IndexedDataset(first)
    assert ds.num_documents == 20000
    assert ds.document(0)[-1] == tok.eod_id


def test_files_to_jsonl_makes_a_corpus_of_text_files(tmp_path):
    """tools/files_to_jsonl.py: sorted, UTF-8 only, duplicates and short / large files dropped, size budget."""
    tool = runpy.run_path(str(Path(__file__).resolve().parents[2] / "tools" / "files_to_jsonl.py"))
    src = tmp_path / "src"
    (src / "b").mkdir(parents=True)
    body = "def f(x):\n    return x + 1\n" * 20
    (src / "b" / "two.py").write_text(body + "# two\n")
    (src / "a.py").write_text(body + "# one\n")
    (src / "copy.py").write_text(body + "# one\n")  # duplicate of a.py
    (src / "short.py").write_text("x = 1\n")
    (src / "latin1.py").write_bytes(b"# caf\xe9\n" * 100)
    (src / "notes.txt").write_text(body)
    (src / "big.py").write_text("y = 2\n" * 100_000)
    out = tmp_path / "corpus.jsonl"
    assert tool["main"]([str(src), "--output", str(out), "--max-file-kb", "64"]) == 0
    texts = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    assert texts == [body + "# one\n", body + "# two\n"]  # a.py, then b/two.py; copy.py was a duplicate
    assert tool["main"]([str(src), "--output", str(out), "--max-mb", "0.0001"]) == 0
    assert len(out.read_text().splitlines()) == 1
