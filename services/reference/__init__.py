"""The reference trainer service: a frozen copy of the base policy serving `ComputeLogprobs` over gRPC."""
