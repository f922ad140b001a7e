"""The compiled parts: two small one-pass float16 kernels.

- ``store/_halfcast.c``: the writer's float32 / bfloat16 -> float16 cast, with its counts;
- ``probes/_halfpool.c``: the probe farm's float16 mean / max pooling.

Everything else is configured in pyproject.toml. Both extensions are optional: without a C
compiler the install still succeeds, and store/dtypes.py and probes/pooling.py use numpy, to the
same bits, slower.
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("store._halfcast", ["store/_halfcast.c"], depends=["store/_clones.h"], optional=True),
    Extension("probes._halfpool", ["probes/_halfpool.c"], depends=["store/_clones.h"], optional=True),
])
