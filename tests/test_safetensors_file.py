"""`save_safetensors`: the file gets the mode open() would give it, not safetensors' private 0600."""

import os
import stat

import pytest
import torch
from safetensors.torch import load_file

from megadlms.safetensors_file import save_safetensors


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
