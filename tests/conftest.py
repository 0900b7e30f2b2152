import os

import pytest
import torch

if "PYTEST_XDIST_WORKER" in os.environ:
    # `pytest -n auto`: a worker per core, so one thread each, and the same for the scripts tests start (two
    # processes with 2 OpenMP threads each on 2 cores spin-wait on each other)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 2)))


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread (and a busy 2-core machine turns 2 threads into spin-waiting); for the
    modules that mark themselves `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_dynamo():
    """Compile caches are per code object and process-wide: start and leave each compile test clean."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
