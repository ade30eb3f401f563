"""The inference server: an engine (vLLM or transformers) behind gRPC and an OpenAI-compatible HTTP API.

Start it with `fleetrl serve inference --model PATH --engine vllm|hf` (see docs/inference.md).
"""
