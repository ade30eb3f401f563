"""fleetrl's services, one package per service, installed as `fleetrl.services.<name>`."""
