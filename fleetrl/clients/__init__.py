"""Python clients of the services' gRPC APIs, and the types they carry: used by other services, `fleetrl up`, the
sampler in the user's rollout and tests. Services import these; nothing here imports a service."""
