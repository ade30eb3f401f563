"""The rollout gateway service: runs the user's rollout function against inference replicas at high concurrency."""
