"""The rollout gateway's pure logic: group assembly, filters and the circuit breaker (no sockets here)."""
