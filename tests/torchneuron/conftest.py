"""The device's C++ extension is compiled once per test session, before any script."""
import pytest
from torchneuron_support import warm_cache


@pytest.fixture(scope="session", autouse=True)
def device_extension():
    warm_cache()
