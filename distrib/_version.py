"""The package version, in a module of its own so that nothing inside distrib imports the package root."""

__version__ = "0.1.0"
