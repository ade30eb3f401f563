"""`python -m fleetrl ...`: the `fleetrl` command (fleetrl/commands/main.py) without the console script."""

import sys

from fleetrl.commands.main import main

if __name__ == "__main__":
    sys.exit(main())
