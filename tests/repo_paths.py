"""Where the tests find the repository and their data, wherever the test file sits; its benchmark scripts as
modules."""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
TEST_DATA = REPO / "tests" / "data"
BENCHMARKS = REPO / "benchmarks"


def load_benchmark(name: str, module_name: str | None = None):
    """`benchmarks/<name>.py` imported as the module `module_name` (default `name`), registered in `sys.modules`
    (its dataclasses look their module up); its `main` runs only when called."""
    spec = importlib.util.spec_from_file_location(module_name or name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
