"""`save_safetensors`: the file gets the mode open() would give it, not safetensors' private 0600; the readers name a
damaged file."""

import os
import re
import stat

import pytest
import torch
from safetensors.torch import load_file

from megadlms.safetensors_file import SafetensorsFileError, load_safetensors, open_safetensors, save_safetensors


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_the_file_follows_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        path = tmp_path / "w.safetensors"
        save_safetensors({"w": torch.arange(6.0).view(2, 3)}, path, metadata={"format": "pt"})
        (tmp_path / "plain").write_text("x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask == stat.S_IMODE((tmp_path / "plain").stat().st_mode)
    assert torch.equal(load_file(path)["w"], torch.arange(6.0).view(2, 3))


@pytest.mark.parametrize("keep, reason", [(4, "header too small"), (200, "incomplete metadata")])
def test_a_truncated_file_is_named_by_every_reader(tmp_path, keep, reason):
    path = tmp_path / "w.safetensors"
    save_safetensors({"w": torch.arange(600.0)}, path)
    assert torch.equal(load_safetensors(path)["w"], torch.arange(600.0))
    path.write_bytes(path.read_bytes()[:keep])
    shown = rf"^{re.escape(str(path))} is not a complete safetensors file \({reason}.*\): it is truncated"
    with pytest.raises(SafetensorsFileError, match=shown):
        load_safetensors(path)
    with pytest.raises(SafetensorsFileError, match=shown), open_safetensors(path) as f:
        f.get_tensor("w")
