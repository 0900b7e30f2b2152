import os

import pytest
import torch

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 2)))


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread (and a busy 2-core machine turns 2 threads into spin-waiting); for the
    modules that mark themselves `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
