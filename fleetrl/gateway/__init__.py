"""The rollout gateway: pure logic (`assembly`: group assembly; `dynamic_filter`; `circuit_breaker`), the `Gateway`
that runs the user's rollouts against the controller and inference replicas (`worker`), its settings (`config`,
`flags`) and `run.run_gateway`, which `fleetrl serve gateway` and `fleetrl.main()`'s in-process gateways both use."""
