"""`fleetrl up`: every service as a local process on loopback, supervised (the embedded default)."""
