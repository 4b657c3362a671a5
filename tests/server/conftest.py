"""Fixtures of the neuronmp-serve tests: a model repository and a server started once per
test module (a module that needs other settings defines its own ``server``)."""
from __future__ import annotations

import pytest
from server.test_server import Server, _make_repository


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("repository"))
    _make_repository(root)
    return root


@pytest.fixture(scope="module")
def server(repo):
    s = Server(repo)
    yield s
    assert s.stop() == 0
