"""The process shell every fleetrl service runs in, written once: command-line pieces (`args`) and the serving
lifecycle (`service`: metrics endpoint, ready file, signal-driven graceful stop, exit code).

A service's own folder (services/<name>/) then holds only what is its own: `launcher.py` parses flags into the
service's config and makes one call, `server.py` wires the parts into a `Service`, and `servicer.py` answers its
gRPC API.
"""
