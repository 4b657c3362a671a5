"""Build script: the package itself is described in setup.cfg."""
from setuptools import setup

setup()
