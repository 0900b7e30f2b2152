"""`python -m hf_budgetdraft.app [--port N] [--share]`: the same as `hf-budgetdraft demo`."""

import sys

from ..cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
