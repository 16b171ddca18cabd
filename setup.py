"""Build hook: compiles the C n-gram matcher (csrc/) through cffi in API mode."""
from setuptools import setup

setup(cffi_modules=["csrc/ngram_build.py:ffibuilder"])
