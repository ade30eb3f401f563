"""Package discovery: the top-level services/ folder is installed as fleetrl.services."""

from setuptools import find_packages, setup

services = ["fleetrl.services"] + [f"fleetrl.services.{p}" for p in find_packages("services")]
setup(
    packages=find_packages(include=["fleetrl", "fleetrl.*"]) + services,
    package_dir={"fleetrl.services": "services"},
    package_data={"fleetrl": ["py.typed"], "fleetrl.services": ["**/*.json"]},
)
