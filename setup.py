"""Build hook: compiles the C n-gram matcher (csrc/) through cffi in API mode."""
from setuptools import setup

setup(cffi_modules=["localspec/_ngram_build.py:ffibuilder"])
