"""Maps the top-level kernels/ folder (CUDA C sources) to the package distrib.kernels; pyproject.toml has the rest."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["distrib", "distrib.*"]), "distrib.kernels"],
      package_dir={"distrib.kernels": "kernels"})
