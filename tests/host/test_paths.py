"""neuronmp.host.paths: the one home of the runtime directory and its folders."""
from __future__ import annotations

import os
import pathlib
import re

import pytest

from neuronmp.cli import ls, top
from neuronmp.errors import RuntimeDirError
from neuronmp.host import paths

PACKAGE = pathlib.Path(paths.__file__).parent.parent   # the whole neuronmp package


def test_configured_dir_follows_the_environment_and_is_absolute(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(paths.ENV_RUNTIME_DIR, "relative/rt")
    assert paths.configured_runtime_dir() == str(tmp_path / "relative" / "rt")
    monkeypatch.delenv(paths.ENV_RUNTIME_DIR)
    assert paths.configured_runtime_dir() == paths.default_runtime_dir()


def test_readers_never_create_anything(monkeypatch, runtime_dir):
    missing = os.path.join(runtime_dir, "not-yet")
    monkeypatch.setenv(paths.ENV_RUNTIME_DIR, missing)
    assert paths.existing_runtime_dir() is None
    assert paths.cores_dir(create=False) is None and paths.shm_dir(create=False) is None
    assert paths.existing_subdir("shm", missing) is None
    assert not os.path.lexists(missing)


def test_writers_create_private_folders(monkeypatch, runtime_dir):
    fresh = os.path.join(runtime_dir, "fresh")
    monkeypatch.setenv(paths.ENV_RUNTIME_DIR, fresh)
    shm = paths.shm_dir()
    cores = paths.cores_dir()
    assert shm == os.path.join(fresh, "shm") and cores == os.path.join(fresh, "cores")
    for d in (fresh, shm, cores):
        assert os.stat(d).st_mode & 0o777 == 0o700
    assert paths.existing_runtime_dir() == fresh
    assert paths.shm_dir(create=False) == shm and paths.cores_dir(create=False) == cores


@pytest.mark.parametrize("which", ["root", "shm", "cores"])
def test_existing_folders_are_checked_like_created_ones(runtime_dir, which):
    paths.shm_dir()
    paths.cores_dir()
    target = runtime_dir if which == "root" else os.path.join(runtime_dir, which)
    os.chmod(target, 0o777)
    try:
        with pytest.raises(RuntimeDirError, match="writable by others"):
            if which == "root":
                paths.existing_runtime_dir()
            else:
                getattr(paths, f"{which}_dir")(create=False)
    finally:
        os.chmod(target, 0o700)


def test_a_dangling_symlink_is_refused_not_taken_for_absent(monkeypatch, runtime_dir):
    link = os.path.join(runtime_dir, "link")
    os.symlink(os.path.join(runtime_dir, "elsewhere"), link)
    monkeypatch.setenv(paths.ENV_RUNTIME_DIR, link)
    with pytest.raises(RuntimeDirError, match="not a directory"):
        paths.existing_runtime_dir()


def test_top_refuses_a_shm_folder_writable_by_others(runtime_dir):
    """neuronmp-top reads statistics segments from the shm folder: it is checked like the
    runtime directory (it was read unchecked before paths owned it)."""
    shm = paths.shm_dir()
    os.chmod(shm, 0o777)
    try:
        with pytest.raises(RuntimeDirError, match="shm"):
            top.sample(16)
        assert top.main(["--once", "--interval", "0.01"]) == 2
    finally:
        os.chmod(shm, 0o700)
    assert top.sample(16)["dir"] == runtime_dir


def test_ls_and_top_report_the_configured_dir_without_creating_it(monkeypatch, runtime_dir):
    missing = os.path.join(runtime_dir, "absent")
    monkeypatch.setenv(paths.ENV_RUNTIME_DIR, missing)
    assert ls.inventory()["runtime_dir"] == missing
    assert top.sample(16)["dir"] is None
    assert not os.path.lexists(missing)


def test_only_paths_reads_the_runtime_dir_variable_or_names_its_folders():
    """One home: no other module works out the runtime directory or joins its folders."""
    offenders = []
    for source in PACKAGE.rglob("*.py"):
        if source == pathlib.Path(paths.__file__):
            continue
        text = source.read_text()
        if re.search(r"ENV_RUNTIME_DIR\)|default_runtime_dir\(|"
                     r"path\.join\([^)]*[\"'](shm|cores)[\"']", text):
            offenders.append(str(source.relative_to(PACKAGE)))
    assert not offenders
