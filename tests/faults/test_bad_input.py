"""Bad input to every command ends in one line naming the value and the fix (exit status 2), never a traceback;
a few cases are warnings on a run that goes on. Each case's id says what the user sees."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from megadlms import cli
from megadlms.data.indexed import IndexedDatasetBuilder

from .conftest import TINY, tiny_trainer

LONG_PROMPT = "once upon a time " * 12


@pytest.fixture(scope="module")
def files(tmp_path_factory, saved_run) -> Path:
    d = tmp_path_factory.mktemp("bad")
    (d / "unparsable.yaml").write_text("train-iters: [1\n")
    (d / "list.yaml").write_text("- a\n- b\n")
    (d / "unknown.yaml").write_text("train-itres: 3\n")
    (d / "listvalue.yaml").write_text("train-iters: [1, 2]\n")
    (d / "choice.yaml").write_text("lr-decay-style: wobbly\n")
    (d / "fraction.yaml").write_text("train-iters: 2.5\n")
    (d / "text.yaml").write_text("lr: fast\n")
    (d / "binary.yaml").write_bytes(b"\xff\xfe\x00\x81")
    (d / "empty.jsonl").write_text("")
    (d / "blank.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    (d / "one.jsonl").write_text('{"text": "hello world"}\n')
    (d / "notjson.jsonl").write_text("not json\n")
    (d / "nokey.jsonl").write_text('{"body": "hello"}\n')
    (d / "nojsonl").mkdir()
    (d / "tokenizer.json").write_text("{}")
    (d / "prompts.jsonl").write_text("{bad\n")
    (d / "noprompt.jsonl").write_text('{"text": "x"}\n')
    for name, docs in (("empty", []), ("blank", [[], []]), ("big_ids", [[5, 6, 99999, 7]])):
        b = IndexedDatasetBuilder(d / name, dtype=np.int32)
        for doc in docs:
            b.add_document(np.array(doc, dtype=np.int32))
        b.finalize()
    short = d / "short_positions"  # a model built for 16 positions
    tiny_trainer("--train-iters", "1", "--save", str(short), "--max-position-embeddings", "16").run()
    nonnum = d / "nonnum"
    shutil.copytree(saved_run, nonnum)
    (nonnum / "latest_checkpointed_iteration.txt").write_text("abc\n")
    (d / "run").symlink_to(saved_run)
    return d


GEN = ["--no-progress", "--device", "cpu", "--gen-length", "4", "--block-length", "4"]
# id (command-case->what the user sees): (argv with {d} for the files folder, rc, pattern of the one line)
CASES = {
    # train: config files
    "train-yaml-unparsable->line-and-column": (["train", "--config", "{d}/unparsable.yaml"], 2,
                                               r"--config \S+ is not valid YAML at line 2, column 1"),
    "train-yaml-a-list->expected-mapping": (["train", "--config", "{d}/list.yaml"], 2, r"expected a mapping"),
    "train-yaml-unknown-key->names-key": (["train", "--config", "{d}/unknown.yaml"], 2, r"unknown key 'train-itres'"),
    "train-yaml-list-for-int->names-flag": (["train", "--config", "{d}/listvalue.yaml"], 2,
                                            r"\[1, 2\] is not a valid int for --train-iters"),
    "train-yaml-fraction-for-int->names-flag": (["train", "--config", "{d}/fraction.yaml"], 2,
                                                r"2.5 is not a valid int for --train-iters"),
    "train-yaml-bad-choice->lists-choices": (["train", "--config", "{d}/choice.yaml"], 2,
                                             r"'wobbly' is not one of \['constant'"),
    "train-yaml-text-for-float->argparse-line": (["train", "--config", "{d}/text.yaml"], 2,
                                                 r"argument --lr: invalid float value: 'fast'"),
    "train-yaml-binary->not-yaml": (["train", "--config", "{d}/binary.yaml"], 2, r"--config \S+binary.yaml"),
    "train-yaml-missing->cannot-read": (["train", "--config", "{d}/nope.yaml"], 2,
                                        r"cannot read it \(No such file or directory\)"),
    # train: data and tokenizers
    "train-empty-dataset->no-training-data": (["train", *TINY, "--data-path", "{d}/empty"], 2,
                                              r"no training data: .*\(0 documents, 0 tokens\)"),
    "train-zero-length-documents->no-training-data": (["train", *TINY, "--data-path", "{d}/blank"], 2,
                                                      r"\(2 documents, 0 tokens\) holds no tokens"),
    "train-ids-past-vocabulary->names-id": (["train", *TINY, "--data-path", "{d}/big_ids"], 2,
                                            r"holds token id 99999, outside the tokenizer's vocabulary of 4096"),
    "train-missing-dataset->names-files": (["train", *TINY, "--data-path", "{d}/nothing"], 2,
                                           r"--data-path \S+nothing: no dataset there"),
    "train-bad-split->names-split": (["train", *TINY, "--split", "a,b"], 2, r"--split 'a,b' is not a list"),
    "train-broken-tokenizer->cannot-load": (["train", *TINY, "--tokenizer-model", "{d}/tokenizer.json"], 2,
                                            r"cannot load tokenizer"),
    "train-missing-tokenizer->not-found": (["train", *TINY, "--tokenizer-model", "{d}/none.json"], 2,
                                           r"tokenizer not found"),
    # train: flags and checkpoints
    "train-checkpoint-args-without-load->needs-load": (["train", *TINY, "--use-checkpoint-args"], 2,
                                                       r"--use-checkpoint-args needs --load"),
    "train-load-missing-folder->names-folder": (["train", *TINY, "--load", "{d}/nothing"], 2,
                                                r"no checkpoint folder \S+nothing"),
    "train-load-non-numeric-latest->lists-whole-ones": (["train", *TINY, "--load", "{d}/nonnum"], 2,
                                                        r"should hold an iteration number, not 'abc'.*: 1, 2"),
    "train-save-unwritable->could-not-save": (["train", *TINY, "--train-iters", "1", "--save", "/proc/none/ck"], 2,
                                              r"/proc/none: No such file or directory"),
    "train-max-skipped-negative->range": (["train", "--max-skipped-steps", "-1"], 2, r"must be >= 0"),
    "train-keep-last-zero->range": (["train", "--ckpt-keep-last", "0"], 2, r"--ckpt-keep-last 0 must be >= 1"),
    "train-exit-duration-negative->range": (["train", "--exit-duration-in-mins", "-1"], 2, r"must be >= 0.0"),
    "train-save-failures-negative->range": (["train", "--ckpt-save-failures-ok", "-2"], 2, r"must be >= 0"),
    "train-unknown-device->names-device": (["train", *TINY, "--device", "tpu"], 2, r"--device 'tpu' is not "),
    "train-batch-not-divisible->names-sizes": (["train", *TINY, "--global-batch-size", "3"], 2,
                                               r"--global-batch-size 3 is not divisible"),
    # preprocess
    "preprocess-not-json->names-line": (["preprocess", "--input", "{d}/notjson.jsonl", "--output-prefix", "{d}/o1"],
                                        2, r"notjson.jsonl, line 1: not valid JSON"),
    "preprocess-missing-key->names-key": (["preprocess", "--input", "{d}/nokey.jsonl", "--output-prefix",
                                           "{d}/o2"], 2, r"lacks the key 'text'"),
    "preprocess-missing-input->names-path": (["preprocess", "--input", "{d}/none.jsonl", "--output-prefix", "{d}/o3"],
                                             2, r"does not exist"),
    "preprocess-folder-without-jsonl->names-folder": (["preprocess", "--input", "{d}/nojsonl", "--output-prefix",
                                                       "{d}/o4"], 2, r"holds no"),
    "preprocess-broken-tokenizer->cannot-load": (["preprocess", "--input", "{d}/one.jsonl", "--output-prefix",
                                                  "{d}/o5", "--tokenizer-model", "{d}/tokenizer.json"], 2,
                                                 r"cannot load tokenizer"),
    "preprocess-unwritable-output->names-folder": (["preprocess", "--input", "{d}/one.jsonl", "--output-prefix",
                                                    "/proc/none/x"], 2, r"/proc/none: No such file or directory"),
    "preprocess-zero-workers->names-flag": (["preprocess", "--input", "{d}/one.jsonl", "--output-prefix", "{d}/o6",
                                             "--workers", "0"], 2, r"--workers must be at least 1"),
    "preprocess-empty-input->warning-no-tokens": (["preprocess", "--input", "{d}/empty.jsonl", "--output-prefix",
                                                   "{d}/o7", "--no-progress"], 0,
                                                  r"warning: the output holds no tokens \(0 documents\)"),
    "preprocess-blank-documents->warning-no-tokens": (["preprocess", "--input", "{d}/blank.jsonl", "--output-prefix",
                                                       "{d}/o8", "--no-progress"], 0,
                                                      r"warning: the output holds no tokens \(2 documents\)"),
    # generate
    "generate-prompt-past-positions->names-lengths": (
        ["generate", "--load", "{d}/short_positions", "--prompt", LONG_PROMPT, *GEN], 2,
        r"prompt length \d+ \+ generation length 4 = \d+ exceeds the model's max_position_embeddings=16"),
    "generate-unknown-device->names-device": (["generate", "--load", "{d}/run", "--prompt", "hi", "--device", "tpu"],
                                              2, r"--device 'tpu' is not a device"),
    "generate-cuda-without-gpu->use-cpu": (["generate", "--load", "{d}/run", "--prompt", "hi", "--device", "cuda"],
                                           2, r"CUDA is not available here"),
    "generate-unwritable-output->names-file": (["generate", "--load", "{d}/run", "--prompt", "hi", *GEN,
                                                "--output-file", "/proc/none/out.jsonl"], 2,
                                               r"/proc/none/out.jsonl: No such file or directory"),
    "generate-zero-length->names-value": (["generate", "--load", "{d}/run", "--prompt", "hi", "--no-progress",
                                           "--device", "cpu", "--gen-length", "0"], 2, r"gen_length=0 must be"),
    "generate-block-not-dividing->suggests": (["generate", "--load", "{d}/run", "--prompt", "hi", "--no-progress",
                                               "--device", "cpu", "--gen-length", "10", "--block-length", "3"], 2,
                                              r"not divisible by block_length=3"),
    "generate-negative-temperature->range": (["generate", "--load", "{d}/run", "--prompt", "hi", *GEN,
                                              "--temperature", "-1"], 2, r"temperature=-1.0 must be >= 0"),
    "generate-mask-past-vocabulary->names-id": (["generate", "--load", "{d}/run", "--prompt", "hi", *GEN,
                                                 "--mask-token", "999999"], 2, r"mask_id=999999 is outside"),
    "generate-missing-prompt-file->names-file": (["generate", "--load", "{d}/run", "--prompt-file", "{d}/no.jsonl",
                                                  *GEN], 2, r"--prompt-file \S+ does not exist"),
    "generate-bad-prompt-file->names-line": (["generate", "--load", "{d}/run", "--prompt-file", "{d}/prompts.jsonl",
                                              *GEN], 2, r"prompts.jsonl:1 is not valid JSON"),
    "generate-prompt-file-without-prompt->names-key": (["generate", "--load", "{d}/run", "--prompt-file",
                                                        "{d}/noprompt.jsonl", *GEN], 2, r'needs a "prompt" string'),
    "generate-no-prompts->how-to-pass": (["generate", "--load", "{d}/run", *GEN], 2, r"no prompts: pass --prompt"),
    "generate-missing-iteration->lists-whole-ones": (["generate", "--load", "{d}/run", "--iteration", "9",
                                                      "--prompt", "hi", *GEN], 2,
                                                     r"iter_0000009 is missing or incomplete.*: 1, 2; load one"),
    "generate-non-numeric-latest->names-file": (["generate", "--load", "{d}/nonnum", "--prompt", "hi", *GEN], 2,
                                                r"should hold an iteration number"),
    "generate-missing-hf-folder->how-to-download": (["generate", "--hf-model", "{d}/nothing", "--prompt", "hi",
                                                     *GEN], 2, r"no config.json in"),
    "generate-missing-fp8-export->how-to-export": (["generate", "--fp8-export", "{d}/nothing", "--prompt", "hi",
                                                    *GEN], 2, r"is not an export folder"),
    "generate-zero-batch->range": (["generate", "--load", "{d}/run", "--prompt", "hi", *GEN, "--batch-size", "0"], 2,
                                   r"--micro-batch-size 0 must be > 0"),
    # convert, export, fp8-check, ckpt, unknown commands
    "convert-export-non-numeric-latest->names-file": (["convert", "megadlms-to-hf", "--load", "{d}/nonnum", "--save",
                                                       "{d}/hf1"], 2, r"should hold an iteration number"),
    "convert-import-missing-folder->how-to-download": (["convert", "hf-to-megadlms", "--hf-model", "{d}/nothing",
                                                        "--save", "{d}/imp"], 2, r"no config.json in"),
    "convert-unwritable-save->names-folder": (["convert", "megadlms-to-hf", "--load", "{d}/run", "--save",
                                               "/proc/none/hf"], 2, r"/proc/none: No such file or directory"),
    "convert-bad-shard-size->names-value": (["convert", "megadlms-to-hf", "--load", "{d}/run", "--save", "{d}/hf2",
                                             "--max-shard-size", "lots"], 2, r"size 'lots' is not a number of bytes"),
    "export-missing-checkpoint->names-folder": (["export", "--load", "{d}/nothing", "--save", "{d}/ex1"], 2,
                                                r"no checkpoint folder"),
    "export-unwritable-save->names-folder": (["export", "--load", "{d}/run", "--save", "/proc/none/ex"], 2,
                                             r"/proc/none: No such file or directory"),
    "fp8-check-unknown-device->names-device": (["fp8-check", "--device", "tpu"], 2, r"--device 'tpu' is not a device"),
    "ckpt-verify-missing-folder->names-folder": (["ckpt", "verify", "{d}/nothing"], 2, r"no checkpoint folder"),
    "ckpt-verify-folder-without-checkpoints->says-so": (["ckpt", "verify", "{d}/nojsonl"], 2, r"holds no checkpoint"),
    "unknown-command->usage": (["trian"], 2, r"unknown command 'trian'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line(files, capsys, case):
    argv, want_rc, pattern = CASES[case]
    argv = [a.replace("{d}", str(files)) for a in argv]
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's own errors: one usage line and one error line
        rc = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert rc == want_rc, err
    lines = [x for x in err.splitlines() if re.search(r"(error|warning):|unknown command", x)]
    assert len(lines) == 1, err
    assert re.search(pattern, lines[0]), lines[0]


def test_there_are_at_least_forty_cases():
    assert len(CASES) >= 40 and len({a[0] for a, _, _ in CASES.values()}) >= 7  # every command


def test_an_unexpected_error_keeps_its_traceback(monkeypatch):
    from megadlms.cli import generate as gen_cli

    def bug(*a, **k):
        raise KeyError("a bug")
    monkeypatch.setattr(gen_cli, "_read_prompts", bug)
    with pytest.raises(KeyError, match="a bug"):
        cli.main(["generate", "--load", "x", "--prompt", "hi"])


def test_records_are_json(files):
    assert json.loads((files / "run" / "iter_0000001" / "crc32_00000.json").read_text())
