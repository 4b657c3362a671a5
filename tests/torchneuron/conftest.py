"""The device's C++ extension is compiled once per test session, before any script."""
import os
import shutil

import pytest
from torchneuron_support import warm_cache


@pytest.fixture(scope="session", autouse=True)
def device_extension():
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        pytest.skip(f"the neuron device is compiled on first use: no C++ compiler "
                    f"({compiler!r}) on this host")
    warm_cache()
