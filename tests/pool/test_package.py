"""neuronmp.pool: the names the layers above take from the package, not its modules."""
import subprocess
import sys

import neuronmp.pool


def test_every_public_name_resolves_and_an_unknown_one_is_an_attribute_error():
    for name in neuronmp.pool.__all__:
        assert getattr(neuronmp.pool, name) is not None, name
    try:
        neuronmp.pool.NoSuchName  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchName" in str(exc)
    else:
        raise AssertionError("an unknown name resolved")


def test_importing_the_package_loads_no_torch():
    code = "import sys, neuronmp.pool, neuronmp.pool.stats; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "False"
