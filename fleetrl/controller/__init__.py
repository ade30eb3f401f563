"""The version controller's pure logic: dataset cursor, row leases, step assembly, the stale-group check.

No gRPC or ZeroMQ here; `services/controller` is the transport edge that calls into these classes.
"""
