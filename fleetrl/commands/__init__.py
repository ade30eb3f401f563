"""The command-line programs: `fleetrl` (main.py) and its subcommands (demo, plot, health), the services it starts
found through package entry points (registry.py), and the flags the recipe examples share (recipe.py)."""
