"""The version controller service: row leases, the off-policy gate, step orchestration and weight pushes."""
