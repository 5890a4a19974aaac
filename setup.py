"""Kept for tools and instructions that look for ``setup.py`` (``python setup.py develop``): every
setting lives in pyproject.toml, which setuptools reads; this file adds nothing to it."""

from setuptools import setup

setup()
