"""setup.py marks the C kernels optional, so a failed build would only fall back to numpy, silently
slower: where the install had a compiler, every kernel must be there."""

from __future__ import annotations

import shutil
import sysconfig

import pytest

from probes import pooling
from store import dtypes


@pytest.mark.parametrize(("kernel", "source"), [(lambda: dtypes._halfcast, "store/_halfcast.c"),
                                                (lambda: pooling._halfpool, "probes/_halfpool.c")],
                         ids=["cast", "pooling"])
def test_each_kernel_is_built_where_a_c_compiler_is(kernel, source):
    if shutil.which(sysconfig.get_config_var("CC").split()[0]) is None:
        pytest.skip("no C compiler on PATH")
    assert kernel() is not None, f"run `make setup` (pip install -e .) to build {source}"
