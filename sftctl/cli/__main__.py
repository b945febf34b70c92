"""``python -m sftctl.cli``: the command line, as the console script ``sftctl`` runs it."""

import sys

from sftctl.cli import main

if __name__ == "__main__":
    sys.exit(main())
