"""The JSON-lines reader: records with their line numbers, blank lines skipped, bad lines named by file:line."""

import pytest

from megadlms.errors import MegaDLMsError
from megadlms.jsonl import JSONLinesError, read_jsonl


def test_records_keep_their_line_numbers(tmp_path):
    path = tmp_path / "a.jsonl"
    # a blank line, one of spaces, a CRLF ending and no newline at the end
    path.write_bytes(b'{"prompt": "Once"}\n\n  \n{"prompt": "caf\xc3\xa9", "n": 2}\r\n{"x": []}')
    assert list(read_jsonl(path)) == [(1, {"prompt": "Once"}), (4, {"prompt": "café", "n": 2}), (5, {"x": []})]


@pytest.mark.parametrize("text, message", [
    (b'{"a": 1}\n{"a": 2\n', r"b.jsonl:2 is not valid JSON \(Expecting ',' delimiter at column 8\): '\{\"a\": 2'"),
    (b'{"a": 1}\n[1, 2]\n', r"b.jsonl:2 is a JSON list, expected an object"),
    (b'"text"\n', r"b.jsonl:1 is a JSON str, expected an object"),
    (b'{"a": "\xff"}\n', r"b.jsonl:1 is not valid UTF-8 \(byte 7\)"),
])
def test_a_bad_line_is_named(tmp_path, text, message):
    path = tmp_path / "b.jsonl"
    path.write_bytes(text)
    with pytest.raises(JSONLinesError, match=message) as e:
        list(read_jsonl(path))
    assert isinstance(e.value, MegaDLMsError) and isinstance(e.value, ValueError) and "\n" not in str(e.value)
