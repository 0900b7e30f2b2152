"""Where the tests find the repository and their data, wherever the test file sits."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
TEST_DATA = REPO / "tests" / "data"
