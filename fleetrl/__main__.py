"""`python -m fleetrl ...`: the `fleetrl` command (fleetrl/commands/main.py) without the console script."""

from fleetrl.commands.main import entry

if __name__ == "__main__":
    entry()
