"""Fixtures of the neuronmp-serve tests: a model repository and one server shared by the
modules that need no flags of their own.

    repo           (session) mlp, named, slow: see server/test_server.py
    shared_server  (session) one neuronmp-serve on ``repo``, default flags; started by
                   the first test that asks, stopped (and checked to leave no process,
                   segment or lock) after the last test of this folder
    server         the shared server; a module that needs other settings defines its own

Which modules keep a server of their own, and why: test_shm (a region limit,
NEURONMP_SHM_MAX_REGIONS), test_front (the aiohttp front end beside the shared
server's httptools one), test_app (its own repository and topology).  The shared
server's processes carry the root conftest's SHARED_MARK, so the per-test leak check
passes them by; its runtime directory is its own, not the test's.
"""
from __future__ import annotations

import pathlib
import shutil
import tempfile

import pytest
from server.test_server import Server, _make_repository

_HERE = pathlib.Path(__file__).resolve().parent
_started: list = []   # the shared server, once a test asked for it


@pytest.fixture(scope="session")
def repo(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("repository"))
    # traced in a runtime directory of its own: outside a test (whose runtime_dir fixture
    # is not set up yet) the default is the host's, where other processes hold cores
    build = tempfile.mkdtemp(prefix="nmp-repo-build-", dir="/dev/shm")
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("NEURONMP_RUNTIME_DIR", build)
            mp.setenv("NEURONMP_TOPOLOGY", "1x4")
            _make_repository(root)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return root


@pytest.fixture(scope="session")
def _shared_at_exit():
    yield
    _stop_shared()


@pytest.fixture(scope="module")
def shared_server(repo, _shared_at_exit):
    # started again when a module of this folder comes after the suite left it (a
    # pytest-xdist worker takes the folder's files among others')
    if not _started:
        _started.append(Server(repo))
    return _started[0]


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


def _stop_shared() -> None:
    while _started:
        assert _started.pop().stop() == 0, "the shared neuronmp-serve did not exit cleanly"


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Stop the shared server as the suite leaves this folder, not at the session's end:
    the rest of the suite should not run beside its idle workers."""
    if nextitem is None or _HERE not in nextitem.path.resolve().parents:
        _stop_shared()
