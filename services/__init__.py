"""fleetrl's services, one package per service, installed as `fleetrl.services.<name>`.

setup.py maps the package `fleetrl.services` to this top-level folder (`package_dir`), so an import of
`fleetrl.services.controller.orchestrator` is the file `services/controller/orchestrator.py`: there is no
`fleetrl/services/` folder. A service depends on the library (`fleetrl/`), never the reverse
(tests/unit/architecture checks it).
"""
