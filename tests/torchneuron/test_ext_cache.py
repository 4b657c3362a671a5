"""The extension cache is trusted only when it is this user's alone.

Another user who can write the cache (a team directory, a world-writable one, sticky or
not) could drop a library under the extension's predictable name, which the next process
to touch the device would load, or a symlink where the build stages its copy.  These
tests plant both as a second user (``nobody``, through setpriv) and check that nothing
they planted runs or is written through, and that the error names the variable.
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile

import pytest
from torchneuron_support import facts, run

from neuronmp.torchneuron import _ext

pytestmark = pytest.mark.timeout(900)

NOBODY = 65534
SETPRIV = shutil.which("setpriv")
as_root = pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None,
                             reason="planting as a second user needs root and setpriv")

_PLANTED = r"""
#include <cstdio>
__attribute__((constructor)) static void planted() {
    FILE *f = std::fopen(MARKER, "w");
    if (f) { std::fputs("planted code ran", f); std::fclose(f); }
}
"""

_LOAD = """
import json
from neuronmp.torchneuron import _ext
try:
    _ext.load()
    print(json.dumps(["loaded"]))
except Exception as exc:
    print(json.dumps([type(exc).__name__, str(exc), getattr(exc, "variable", None),
                      getattr(exc, "path", None)]))
"""


@pytest.fixture
def shared():
    """A directory other users can reach (pytest's own tmp is private to root)."""
    path = tempfile.mkdtemp(prefix="neuronmp-team-")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _tag() -> str:
    return os.path.basename(_ext.cache_dir())


def _planted_library(where: str, marker: str) -> str:
    src = os.path.join(where, "planted.cpp")
    out = os.path.join(where, "planted.so")
    with open(src, "w") as f:
        f.write(_PLANTED)
    subprocess.run([os.environ.get("CXX", "c++"), "-shared", "-fPIC", f'-DMARKER="{marker}"',
                    "-o", out, src], check=True, timeout=300)
    os.chmod(out, 0o755)
    return out


def _as_nobody(script: str) -> None:
    subprocess.run([SETPRIV, "--reuid", "nobody", "--regid", "nogroup", "--clear-groups",
                    "sh", "-ec", script], check=True, timeout=60)


def _load(cache: str, cwd) -> list:
    return facts(run(_LOAD, cwd, provide=None, NEURONMP_TORCHNEURON_CACHE=cache))


@as_root
@pytest.mark.parametrize("mode", [0o777, 0o1777])
def test_a_cache_others_can_write_is_refused_and_what_they_planted_never_runs(
        shared, tmp_path, mode):
    cache = os.path.join(shared, "cache")
    os.mkdir(cache)
    os.chmod(cache, mode)
    marker = os.path.join(shared, "marker")
    library = _planted_library(shared, marker)
    victim = os.path.join(shared, "victim")
    with open(victim, "w") as f:
        f.write("the user's own file")
    where = os.path.join(cache, _tag())
    name = _ext.module_name()
    _as_nobody(f"mkdir {where} && chmod 777 {where} && cp {library} {where}/{name}.so && "
               f"ln -s {victim} {where}/{name}.so.partial")

    kind, text, variable, path = _load(cache, tmp_path)
    assert kind == "ExtensionCacheError", text
    assert variable == "NEURONMP_TORCHNEURON_CACHE" and path == cache
    assert "NEURONMP_TORCHNEURON_CACHE" in text and cache in text
    assert "writable by others" in text and "Accepted" in text
    assert not os.path.exists(marker)                      # no planted code ran
    with open(victim) as f:
        assert f.read() == "the user's own file"           # nothing written through the link
    assert os.lstat(os.path.join(where, f"{name}.so")).st_uid == NOBODY


@as_root
@pytest.mark.parametrize("owner, mode", [(NOBODY, 0o755), (None, 0o777)])
def test_the_per_torch_subdirectory_is_checked_too(shared, tmp_path, owner, mode):
    cache = os.path.join(shared, "cache")
    os.mkdir(cache, 0o755)
    where = os.path.join(cache, _tag())
    os.mkdir(where)
    os.chmod(where, mode)
    if owner is not None:
        os.chown(where, owner, -1)
    kind, text, variable, path = _load(cache, tmp_path)
    assert kind == "ExtensionCacheError" and path == where, text
    assert variable == "NEURONMP_TORCHNEURON_CACHE"
    assert ("owned by uid 65534" if owner else "writable by others") in text


@as_root
@pytest.mark.parametrize("how", ["other owner", "writable", "symlink"])
def test_the_library_found_is_checked_before_it_is_loaded(shared, tmp_path, how):
    cache = os.path.join(shared, "cache")
    where = os.path.join(cache, _tag())
    os.makedirs(where, 0o755)
    marker = os.path.join(shared, "marker")
    library = _planted_library(shared, marker)
    target = os.path.join(where, f"{_ext.module_name()}.so")
    if how == "symlink":
        os.symlink(library, target)
    else:
        shutil.copy(library, target)
        if how == "other owner":
            os.chown(target, NOBODY, -1)
        else:
            os.chmod(target, 0o777)
    kind, text, variable, path = _load(cache, tmp_path)
    assert kind == "ExtensionCacheError" and path == target, text
    assert variable == "NEURONMP_TORCHNEURON_CACHE"
    assert {"other owner": "owned by uid 65534", "writable": "writable by others",
            "symlink": "symbolic link"}[how] in text
    assert not os.path.exists(marker)


def test_a_partial_symlink_is_not_followed_when_the_build_stages_its_copy(tmp_path):
    """A stale ``<name>.so.partial`` symlink (planted while the directory was open to
    others, say) is never written through: the staged copy is a fresh file of its own.
    The session's warm build directory is reused, so ninja has nothing to compile."""
    name = _ext.module_name()
    warm = os.path.join(_ext.cache_dir(), f"build-{name}")
    if not os.path.isdir(warm):
        pytest.skip("no warm build directory in the user's cache")
    cache = tmp_path / "cache"
    where = cache / _tag()
    where.mkdir(parents=True, mode=0o700)
    shutil.copytree(warm, where / f"build-{name}", symlinks=True)
    victim = tmp_path / "victim"
    victim.write_text("the user's own file")
    os.symlink(victim, where / f"{name}.so.partial")
    assert _load(str(cache), tmp_path) == ["loaded"]
    assert victim.read_text() == "the user's own file"
    installed = os.lstat(where / f"{name}.so")
    assert stat.S_ISREG(installed.st_mode) and installed.st_size > 0
    assert not installed.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
