"""`python -m hf_budgetdraft.eval [options]` = `hf-budgetdraft bench [options]`."""

import sys

from ..cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
