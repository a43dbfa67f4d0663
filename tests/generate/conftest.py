import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: thread start-up and contention cost more than the math (10x slower on a busy 2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
