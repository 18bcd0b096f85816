"""``python -m megatronish.generate``: see :mod:`megatronish.generate.cli`."""

import sys

from megatronish.generate.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
