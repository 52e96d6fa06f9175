"""`python -m mooncake`: the `mooncake` command (`mooncake.cli`), for when the virtual environment's bin is not on
PATH."""

import sys

from mooncake.cli import main

if __name__ == "__main__":
    sys.exit(main())
