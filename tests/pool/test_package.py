"""neuronmp.pool: the package imports nothing; each name comes from its own module."""
import json
import subprocess
import sys


def _fresh(code: str):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_the_package_hands_out_no_names_of_its_modules():
    got = _fresh("import json, neuronmp.pool as p\n"
                 "print(json.dumps([n for n in vars(p) if not n.startswith('__')]))")
    assert got == []
    got = _fresh("import json, neuronmp.pool as p\n"
                 "print(json.dumps(hasattr(p, 'Pool')))")
    assert got is False   # `from neuronmp.pool.coordinator import Pool`


def test_importing_the_package_and_its_stats_loads_no_torch():
    code = ("import json, sys, neuronmp.pool, neuronmp.pool.stats\n"
            "print(json.dumps('torch' in sys.modules))")
    assert _fresh(code) is False
