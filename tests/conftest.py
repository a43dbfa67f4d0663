"""Shared setup of the test suite."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """The models and matrices in the tests are tiny: one intra-op thread avoids OpenMP start-up and
    contention costs (tens of times slower with 2 threads on a busy 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
