"""What the installed torch can run that some tests need: the package supports torch >= 2.6, its compiled paths
need a dynamo that traces transformers 5's model forward (torch >= 2.9; 2.6-2.8 stop at `set.__contains__` and
`co_varnames` inside transformers' decorators, and the package then runs eagerly, losslessly)."""

import pytest
import torch

TORCH_RELEASE = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])

needs_traceable_transformers = pytest.mark.skipif(
    TORCH_RELEASE < (2, 9),
    reason=f"torch {torch.__version__}'s dynamo cannot trace transformers 5's forward (compiled paths need >= 2.9)",
)
