"""Kept for tools and instructions that look for ``setup.py`` (``python setup.py develop``): every
setting lives in pyproject.toml, which setuptools reads; this file adds nothing to it."""

import os

from setuptools import setup

# setuptools reads pyproject.toml from the working directory: run from elsewhere
# (python /path/to/setup.py --version) it would report UNKNOWN 0.0.0
os.chdir(os.path.dirname(os.path.abspath(__file__)))
setup()
