"""``python -m megatronish.plan``: see :mod:`megatronish.plan.cli`."""

import sys

from megatronish.plan.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
