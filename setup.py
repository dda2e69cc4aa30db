"""Thin shim for tools that still call `setup.py`: the package is defined in pyproject.toml (`pip install .` or
`pip install -e .`)."""

from setuptools import setup

setup()
