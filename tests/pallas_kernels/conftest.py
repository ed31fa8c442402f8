"""The kernel tests exercise the Pallas kernels themselves (interpret mode on a CPU: they are the
GPU path and the reference for GPU bits), so JDET_PALLAS_INTERPRET=1 is set for every test here
except those of the CPU fast path (`test_xla_fixed.py`), which choose `backend="xla"` explicitly.
"""

import pytest

from pallas_kernels import _platform


@pytest.fixture(autouse=True)
def _pallas_kernels_in_interpret_mode(request, monkeypatch):
    if request.node.module.__name__.rsplit(".", 1)[-1] != "test_xla_fixed":
        monkeypatch.setenv(_platform.INTERPRET_ENV, "1")
