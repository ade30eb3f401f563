"""The policy trainer service: rollout groups in over ZeroMQ, gRPC control, weights out on the weight stream."""
