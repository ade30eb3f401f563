"""Process exit codes the services use to tell `fleetrl up` (and any supervisor) why they stopped.

A supervisor restarts a crashed gateway, but not one that stopped for a reason a restart cannot fix.
"""

EXIT_CIRCUIT_OPEN = 3
"""A gateway's rollouts kept failing (the circuit breaker opened): the rollout function is broken."""

EXIT_USER_CODE = 4
"""A gateway could not import or build the user's code (rollout factory, evaluation hook, dynamic filter)."""

EXIT_CONTROLLER_LOST = 5
"""A gateway's controller did not answer for `controller_lost_s`: the run finished or stopped and no controller
resumed it, or the address never held a run. A restart would meet the same silence."""
