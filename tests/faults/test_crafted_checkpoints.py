"""Crafted checkpoints: a file whose pickle would run a command (here: create a marker file) when loaded, with its
size and CRC-32 records rewritten so that the integrity checks pass. Every way of loading refuses it with one line
naming the file and the global it asked for, and the command never runs."""

from __future__ import annotations

import json
import os
import pickle
import re
import shlex

import numpy as np
import pytest
import torch

from megadlms import cli
from megadlms.training import checkpoint as ckpt

from .conftest import TINY, logged_losses, tiny_trainer

D = "iter_0000002"
REFUSED = r"which a checkpoint may not contain: refusing to load it"


class _Payload:
    """Unpickling it runs a shell command that creates `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def _rerecord(folder, name: str) -> None:
    """Rewrite the size and CRC-32 recorded for `name`, as whoever crafted the file would."""
    rec = folder / "crc32_00000.json"
    sums = json.loads(rec.read_text())
    sums[name] = {"size": (folder / name).stat().st_size, "crc32": ckpt._crc32(folder / name)}
    rec.write_text(json.dumps(sums))
    assert ckpt.verify_checkpoint(folder) == []


def _craft_rank_state(run, marker) -> None:
    f = run / D / "rank_00000.pt"
    state = torch.load(f, weights_only=False)  # the test's own file
    state["rng"]["python"] = _Payload(marker)
    torch.save(state, f)
    _rerecord(run / D, "rank_00000.pt")


def _craft_dcp_metadata(run, marker) -> None:
    f = run / D / ".metadata"
    with open(f, "rb") as fh:
        meta = pickle.load(fh)  # the test's own file
    meta.storage_meta.save_id = _Payload(marker)
    f.write_bytes(pickle.dumps(meta))
    _rerecord(run / D, ".metadata")


def _craft_dcp_item(run, marker) -> None:
    """Re-save iteration 2 with a non-tensor item (DCP stores those with torch.save in the shard) that is the payload:
    the save itself records the checksums."""
    trainer = tiny_trainer("--train-iters", "2", "--save", str(run), "--load", str(run))
    real = trainer._dcp_state

    def crafted():
        state = real()
        state["train"]["consumed_tokens"] = _Payload(marker)
        return state
    trainer._dcp_state = crafted
    trainer.save()
    assert ckpt.verify_checkpoint(run / D) == []


CRAFTED = {  # id: (craft, the file named)
    "rank-state": (_craft_rank_state, r"rank_00000\.pt"),
    "dcp-metadata": (_craft_dcp_metadata, r"\.metadata"),
    "dcp-shard-item": (_craft_dcp_item, r"__0_\d+\.distcp"),
}


def _refusal(file: str) -> str:
    return rf"checkpoint file \S*{D}/{file} needs '(posix|os|nt)\.system', {REFUSED}"


@pytest.fixture
def marker(tmp_path):
    m = tmp_path / "payload-ran"
    yield m
    assert not m.exists(), "loading the checkpoint ran the command it carried"


@pytest.mark.parametrize("kind", list(CRAFTED))
def test_train_load_refuses_a_crafted_checkpoint(run_copy, marker, capsys, kind):
    craft, file = CRAFTED[kind]
    craft(run_copy, marker)
    rc = cli.main(["train", *TINY, "--train-iters", "3", "--load", str(run_copy)])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if "error:" in x]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert re.search(_refusal(file), lines[0]), lines[0]


def test_load_model_from_checkpoint_refuses_a_crafted_checkpoint(run_copy, marker):
    """What generate, eval, convert and export load through (the model's tensors and the DCP metadata)."""
    _craft_dcp_metadata(run_copy, marker)
    with pytest.raises(ckpt.CheckpointError, match=_refusal(r"\.metadata")) as e:
        ckpt.load_model_from_checkpoint(run_copy)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["rank-state", "dcp-metadata"])
def test_ckpt_verify_refuses_a_crafted_checkpoint(run_copy, marker, capsys, kind):
    craft, file = CRAFTED[kind]
    craft(run_copy, marker)
    assert cli.main(["ckpt", "verify", str(run_copy)]) == 1
    out = capsys.readouterr().out
    assert re.search(rf"{D}: DAMAGED: {_refusal(file)}", out), out
    assert "iter_0000001: ok" in out


def test_rank_state_holds_only_plain_types_and_tensors(saved_run):
    f = saved_run / D / "rank_00000.pt"
    assert torch.serialization.get_unsafe_globals_in_checkpoint(f) == []
    state = torch.load(f, weights_only=True)
    assert isinstance(state["rng"]["numpy"][1], list)


def test_numpy_rng_state_of_earlier_versions_still_resumes_exactly(run_copy, saved_run, capsys):
    """Earlier versions saved np.random.get_state() as is (a numpy array): the allow-list admits it, and the resume
    is exact."""
    folder = run_copy / "iter_0000001"
    f = folder / "rank_00000.pt"
    state = torch.load(f, weights_only=True)
    name, keys, *rest = state["rng"]["numpy"]
    state["rng"]["numpy"] = (name, np.asarray(keys, dtype=np.uint32), *rest)
    torch.save(state, f)
    _rerecord(folder, "rank_00000.pt")
    assert torch.serialization.get_unsafe_globals_in_checkpoint(f)  # needs numpy's globals
    rc = cli.main(["train", *TINY, "--train-iters", "2", "--load", str(run_copy), "--ckpt-step", "1", "--save",
                   str(run_copy)])
    assert rc == 0, capsys.readouterr().err
    assert logged_losses(run_copy)[2] == logged_losses(saved_run)[2]


@pytest.mark.parametrize("content, named", [
    (lambda: {"rng": {"numpy": np.zeros(3, dtype=np.float64)}}, r"needs '[\w.\[\]]*[Ff]loat64[\w\]]*', " + REFUSED),
    (lambda: {"data": slice(0, 4)}, r"needs 'builtins\.slice', " + REFUSED),
    (lambda: pickle.dumps({"rng": _Payload("x")}), r"cannot be read \(UnpicklingError: not a torch\.save archive"),
], ids=["numpy-float64", "slice", "bare-pickle"])
def test_a_tampered_rank_state_names_the_file_and_what_it_refused(tmp_path, content, named):
    """Globals torch's weights-only loader will not build, and a bare pickle: one line naming the file and the
    refused global, never torch's advice to load the file with weights_only=False."""
    folder = tmp_path / "run" / D
    folder.mkdir(parents=True)
    f = folder / "rank_00000.pt"
    obj = content()
    f.write_bytes(obj) if isinstance(obj, bytes) else torch.save(obj, f)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load_rank_state(folder, 0)
    text = str(e.value)
    assert re.search(rf"checkpoint file {re.escape(str(f))} {named}", text), text
    assert "\n" not in text and "weights_only" not in text and "add_safe_globals" not in text


def test_torchs_weights_only_text_never_reaches_a_message():
    """Any weights-only refusal that reaches a checkpoint message is torch's reason alone."""
    e = pickle.UnpicklingError(
        "Weights only load failed. In PyTorch 2.6, we changed the default value of the `weights_only` argument in "
        "`torch.load` from `False` to `True`. Re-running `torch.load` with `weights_only` set to `False` will likely "
        "succeed, but it can result in arbitrary code execution.\nPlease file an issue with the following so that "
        "we can make `weights_only=True` compatible with your use case: WeightsUnpickler error: \n\nUnsupported "
        "operand 149\n\nCheck the documentation of torch.load to learn more")
    text = ckpt._root_text(e)
    assert text == "UnpicklingError: not a torch.save archive of tensors and plain types (Unsupported operand 149)"
