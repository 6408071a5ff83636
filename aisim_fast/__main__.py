"""``python -m aisim_fast ...`` runs the ``aisim-fast`` command line."""

import sys

from aisim_fast.cli.app import main

if __name__ == "__main__":
    sys.exit(main())
