"""The one compiled part: probes/_halfpool.c, the one-pass float16 pooling kernel.

Everything else is configured in pyproject.toml. The extension is optional: without a C compiler
the install still succeeds and probes/pooling.py pools with numpy, to the same bits, slower.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("probes._halfpool", ["probes/_halfpool.c"], optional=True)])
