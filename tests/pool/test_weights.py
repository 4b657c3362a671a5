"""Shared weights: the cores of a model map one read-only copy of its
parameters and buffers; a model that writes to them fails clearly; nothing leaks."""
from __future__ import annotations

import fcntl
import io
import json
import os
import signal
import textwrap
import zipfile

import pytest
import torch
from pool_support import run_on_a_small_tmpfs, script_bytes

import neuronmp
from neuronmp.errors import ConfigError, RuntimeDirError, WeightWriteError
from neuronmp.host import leftovers, paths, topology
from neuronmp.pool import weights as W
from neuronmp.pool.coordinator import Pool
from neuronmp.session.session import current as _current_session
from neuronmp.shm.segment import maps_large_pages


class Wide(torch.nn.Module):
    """Two Linears (about 2 MiB of weights), one tied into a second path, and a buffer."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Linear(512, 512)
        self.b = torch.nn.Linear(512, 512)
        self.tied = self.a  # the same module under two names: one copy in the segment
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / 16)
        self.register_buffer("scale", torch.tensor([0.5, 2.0]).repeat(256))

    def forward(self, x):
        return self.b(torch.relu(self.tied(x))) * self.scale


class Writer(torch.nn.Module):
    """Writes to its weight in forward when the input is negative (scripted, so the
    condition stays a condition)."""

    def __init__(self, n: int = 4):
        super().__init__()
        self.w = torch.nn.Parameter(torch.eye(n) * 3)

    def forward(self, x):
        if bool(x.sum() < 0):
            self.w.add_(1.0)
        return x @ self.w


def _smaps(pid: int, name: str):
    """``pid``'s mapping of segment ``name`` from /proc/<pid>/smaps: its header's
    fields and its counters (kB), or None."""
    with open(f"/proc/{pid}/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        fields = line.split()
        if len(fields) >= 6 and fields[5].endswith("/" + name):
            stats = {}
            for extra in lines[i + 1:]:
                key, _, rest = extra.partition(":")
                if " " in key or not rest.strip():
                    break
                stats[key] = int(rest.split()[0]) if rest.split()[0].isdigit() else rest
            return fields, stats
    return None


def _mapping(pid: int, name: str):
    """(dev, inode, offset, Rss kB, Pss kB, Anonymous kB) of ``pid``'s mapping of
    segment ``name``, or None."""
    found = _smaps(pid, name)
    if found is None:
        return None
    fields, stats = found
    return (fields[3], int(fields[4]), int(fields[2], 16),
            stats["Rss"], stats["Pss"], stats["Anonymous"])


def test_the_cores_of_a_model_map_one_copy_of_its_weights(emulated, runtime_dir):
    emulated("1x4")
    x = torch.randn(8, 512)
    data, mod = script_bytes(Wide().eval(), x)
    pool = _current_session().pool
    cores = pool.cores[:3]
    mids = pool.load_all(cores[:2], data) + (pool.load(cores[2], data),)  # as DataParallel
    (weights,) = pool.shared_weights()
    assert len(weights.skeleton) < len(data) / 10   # the cores load kilobytes, not the weights
    assert weights.nbytes < 2.5 * 512 * 512 * 4      # a, b, biases, buffer: `tied` not again
    for core, mid in zip(cores, mids):
        torch.testing.assert_close(pool.call(core, mid, (x,)).result(), mod(x))
    maps = [_mapping(pool.worker_pid(core), weights.segment.name) for core in cores]
    assert all(m is not None for m in maps), maps
    assert len({m[:3] for m in maps}) == 1, maps        # one file, same offset, in every worker
    for *_, rss, pss, anonymous in maps:
        # every page resident, none copied, each counted a third in each of 3 workers
        assert rss > 2 * 1024 and anonymous == 0 and pss * 3 <= rss + 12, maps


def _segment_names(runtime_dir):
    shm = os.path.join(runtime_dir, "shm")
    return os.listdir(shm) if os.path.isdir(shm) else []


@pytest.mark.parametrize("n", [4, 1100])
def test_a_model_that_writes_its_weights_is_refused_and_its_core_lives(runtime_dir, n):
    """Small weights on tmpfs; 4.8 MB where they are mapped a huge page at a time, if
    this host has such a place (a write splits the huge entry and copies one page)."""
    data, _ = script_bytes(Writer(n))
    pool = _current_session().pool
    core = pool.cores[1]
    mid = pool.load(core, data)
    pid = pool.worker_pid(core)
    x = torch.ones(2, n)
    with pytest.raises(WeightWriteError) as info:
        pool.call(core, mid, (-x,)).result()
    err = info.value
    assert (err.core, err.model, err.module, err.tensors) == (core, mid, "Writer", ("w",))
    assert f"model {mid} (Writer) on NeuronCore {core} wrote to its weights" in str(err)
    assert "NEURONMP_SHARE_WEIGHTS=0" in str(err)
    # the core is alive and its weights are the shared ones again
    assert torch.equal(pool.call(core, mid, (x,)).result(), x * 3)
    with pytest.raises(WeightWriteError):
        pool.call(core, mid, (-x,)).result()
    assert torch.equal(pool.call(core, mid, (x,)).result(), x * 3)
    assert pool.worker_pid(core) == pid and pool.stats()[1].restarts == 0
    (weights,) = pool.shared_weights()
    pool.unload(core, mid)  # the last core gives the weights back: the file goes
    assert pool.shared_weights() == () and weights.segment.name not in _segment_names(runtime_dir)


class InPlace(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x):
        self.calls += 1     # state kept in a buffer: a write to the shared copy
        return x + self.calls


def test_a_traced_model_that_writes_fails_in_the_caller_with_the_named_error():
    traced = neuronmp.trace(InPlace(), torch.zeros(2, 3))
    with pytest.raises(WeightWriteError, match=r"\(InPlace\) on NeuronCore \d+ wrote to its "
                                               r"weights in forward \(calls\)"):
        traced(torch.zeros(2, 3))


_PRIVATE = textwrap.dedent("""
    import json, torch, neuronmp
    class InPlace(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(1))
        def forward(self, x):
            self.calls += 1
            return x + self.calls
    traced = neuronmp.trace(InPlace(), torch.zeros(1))
    big = torch.nn.Linear(512, 1024).eval()   # 2 MiB: sent whole, loaded from a file
    x = torch.randn(3, 512)
    traced_big = neuronmp.trace(big, x)
    from neuronmp.session.session import current
    print(json.dumps({"out": [traced(torch.zeros(1)).item() for _ in range(2)],
                      "big_same": torch.equal(traced_big(x), big(x)),
                      "shared": len(current().pool.shared_weights())}))
""")


def test_share_weights_off_gives_each_core_a_writable_copy(procs):
    proc = procs.python(_PRIVATE, env={"NEURONMP_SHARE_WEIGHTS": "0",
                                       "NEURON_RT_VISIBLE_CORES": "0"})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    got = json.loads(out)   # the core's own copy counts on from where trace left it
    assert got["shared"] == 0 and got["out"][1] == got["out"][0] + 1 and got["big_same"]
    bad = procs.python("import neuronmp.session.session; neuronmp.session.session.current().pool",
                       env={"NEURONMP_SHARE_WEIGHTS": "yes"})
    _, err = bad.communicate(timeout=60)
    assert bad.returncode != 0 and "Invalid NEURONMP_SHARE_WEIGHTS='yes'" in err


@pytest.mark.parametrize("width", [512, 1024])
def test_a_replacement_worker_maps_the_same_weights(runtime_dir, width):
    """2 MiB of weights on tmpfs, or 4 MiB where large weights go (the page cache,
    on a host whose temp filesystem maps them a huge page at a time)."""
    x = torch.randn(4, width)
    model = Wide() if width == 512 else torch.nn.Linear(width, width)
    data, mod = script_bytes(model.eval(), x)
    pool = _current_session().pool
    core = pool.cores[0]
    mid = pool.load(core, data)
    (weights,) = pool.shared_weights()
    victim = pool.worker_pid(core)
    os.kill(victim, signal.SIGKILL)
    got = pool.call(core, mid, (x,)).result(timeout=60)   # sent to the replacement
    torch.testing.assert_close(got, mod(x))
    assert pool.worker_pid(core) != victim
    assert _mapping(pool.worker_pid(core), weights.segment.name) is not None
    assert pool.shared_weights() == (weights,)


def test_weight_write_error_pickles_with_its_fields():
    import pickle

    err = WeightWriteError(3, 7, "Net", ["fc.weight"])
    again = pickle.loads(pickle.dumps(err))
    assert (again.core, again.model, again.module, again.tensors) == (3, 7, "Net",
                                                                      ("fc.weight",))
    assert isinstance(again, RuntimeError) and "NeuronCore 3" in str(again)


@pytest.mark.parametrize("setting", ["auto", "shm"])
def test_large_weights_go_where_the_cores_map_them_a_huge_page_at_a_time(runtime_dir, setting,
                                                                        monkeypatch):
    """4 MiB and more: under ``auto`` the page-cache twin when tmpfs maps 4 KiB pages
    and the twin 2 MiB ones, and each core's mapping then takes PMD entries; ``shm``
    keeps them on tmpfs.  Nothing is left in either place, and the twin goes with the
    runtime directory."""
    monkeypatch.setenv("NEURONMP_WEIGHTS_DIR", setting)
    x = torch.randn(3, 1024)
    data, mod = script_bytes(torch.nn.Linear(1024, 1024).eval(), x)
    pool = _current_session().pool
    mids = pool.load_all(pool.cores[:2], data)
    (weights,) = pool.shared_weights()
    shm = os.path.join(runtime_dir, "shm")
    twin = paths.page_cache_dir(runtime_dir) if setting == "auto" else None
    huge = {d: maps_large_pages(d) for d in (shm, twin) if d}
    want = twin if twin and huge[twin] and not huge[shm] else shm
    assert os.path.dirname(weights.segment.path) == want and weights.nbytes >= W.LARGE
    for core, mid in zip(pool.cores, mids):
        torch.testing.assert_close(pool.call(core, mid, (x,)).result(), mod(x))
        _fields, stats = _smaps(pool.worker_pid(core), weights.segment.name)
        pmd = stats["FilePmdMapped"] + stats["ShmemPmdMapped"]
        assert (pmd >= 2048) == huge[want] and stats["Anonymous"] == 0, stats
    if want == twin:   # held against systemd-tmpfiles, which skips a directory so locked
        fd = os.open(twin, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    for core, mid in zip(pool.cores, mids):
        pool.unload(core, mid)
    assert pool.shared_weights() == () and not os.path.exists(weights.segment.path)
    neuronmp.shutdown()   # the last user of the runtime directory tidies the twin too
    assert not os.path.exists(runtime_dir) and not (twin and os.path.exists(twin))


def test_an_automatic_twin_not_ours_alone_leaves_large_weights_on_tmpfs(runtime_dir):
    """Made writable by others (as someone else's would be in a shared /tmp), the
    twin is passed over, not an error: the pool starts and the weights go to tmpfs."""
    twin = paths.page_cache_dir(runtime_dir)
    os.chmod(twin, 0o777)
    data, _ = script_bytes(torch.nn.Linear(1024, 1024).eval(), torch.zeros(1, 1024))
    pool = _current_session().pool
    pool.load(pool.cores[0], data)
    (weights,) = pool.shared_weights()
    assert os.path.dirname(weights.segment.path) == os.path.join(runtime_dir, "shm")
    assert paths.page_cache_dir(runtime_dir) is None and os.listdir(twin) == []


def test_small_weights_stay_on_tmpfs(runtime_dir):
    data, _ = script_bytes(Wide().eval(), torch.zeros(1, 512))   # 2 MiB: under LARGE
    pool = _current_session().pool
    pool.load(pool.cores[0], data)
    (weights,) = pool.shared_weights()
    assert os.path.dirname(weights.segment.path) == os.path.join(runtime_dir, "shm")


_NO_ROOM_TO_LOAD_FROM_A_FILE = textwrap.dedent("""
    import json, os
    os.environ["NEURONMP_SHARE_WEIGHTS"] = "0"   # the graph goes whole to the core
    import torch, neuronmp
    x = torch.randn(2, 640)
    net = torch.nn.Linear(640, 1024).eval()   # 2.6 MB: its spill arena and its scratch
    traced = neuronmp.trace(net, x)           # file do not both fit in 6 MiB
    print(json.dumps({"same": torch.equal(traced(x), net(x))}))
""")


def test_a_whole_graph_loads_from_memory_when_tmpfs_has_no_room_for_its_file(procs,
                                                                              tmp_path):
    got = run_on_a_small_tmpfs(procs, tmp_path, _NO_ROOM_TO_LOAD_FROM_A_FILE, 6)
    assert got == {"same": True}, got


_NO_SPACE_IN_THE_PAGE_CACHE = textwrap.dedent("""
    import json, os, torch, neuronmp
    from neuronmp.host import paths
    from neuronmp.shm.segment import maps_large_pages
    from neuronmp.session.session import current
    x = torch.randn(2, 1024)
    net = torch.nn.Linear(1024, 2048).eval()   # 8 MiB: more than TMPDIR's tmpfs holds
    traced = neuronmp.trace(net, x)
    (weights,) = current().pool.shared_weights()
    twin = paths.page_cache_dir()
    print(json.dumps({"dir": os.path.dirname(weights.segment.path),
                      "twin_first": maps_large_pages(twin),
                      "twin_left": [n for n in os.listdir(twin) if not n.endswith(".live")],
                      "same": torch.equal(traced(x), net(x))}))
""")


def test_large_weights_fall_back_to_tmpfs_when_the_page_cache_has_no_room(procs, tmp_path,
                                                                          runtime_dir):
    """TMPDIR a 6 MiB tmpfs with huge pages, so the probe picks it for 8 MiB of weights,
    which do not fit: they go to the runtime directory's tmpfs instead, and the
    model loads."""
    got = run_on_a_small_tmpfs(procs, tmp_path, _NO_SPACE_IN_THE_PAGE_CACHE, 6,
                               as_tmpdir=True, options=",huge=always")
    assert got == {"dir": os.path.join(runtime_dir, "shm"), "twin_first": True,
                   "twin_left": [], "same": True}, got


@pytest.mark.parametrize("value, error", [
    ("weights", "Invalid NEURONMP_WEIGHTS_DIR='weights': a relative path"),
    ("open", "Refusing shared-weights directory .*: it is writable by others"),
])
def test_a_bad_weights_dir_fails_at_pool_start(value, error, tmp_path, monkeypatch):
    import pickle

    if value == "open":
        value = str(tmp_path / "open")
        os.mkdir(value)
        os.chmod(value, 0o777)
    monkeypatch.setenv("NEURONMP_WEIGHTS_DIR", value)
    with pytest.raises((ConfigError, RuntimeDirError), match=error) as info:
        Pool([0], topology.parse("1x1"))
    assert value in str(info.value)
    assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)


_OWNER_KILLED = textwrap.dedent("""
    import json, os, sys, torch, neuronmp
    m = neuronmp.trace(torch.nn.Linear(256, 256), torch.zeros(2, 256))
    m(torch.zeros(2, 256))
    from neuronmp.session.session import current
    pool = current().pool
    print(json.dumps([w.segment.name for w in pool.shared_weights()]), flush=True)
    sys.stdin.read()
""")


@pytest.mark.parametrize("named", [False, True])
def test_a_dead_owners_weights_are_swept(procs, runtime_dir, tmp_path, monkeypatch, named):
    """On tmpfs, or in the directory NEURONMP_WEIGHTS_DIR names (the page cache): the
    leak check sees what a SIGKILLed owner left, and the next pool start sweeps it."""
    import subprocess

    env = {"NEURON_RT_VISIBLE_CORES": "0"}
    if named:
        env["NEURONMP_WEIGHTS_DIR"] = str(tmp_path / "weights")
        monkeypatch.setenv("NEURONMP_WEIGHTS_DIR", env["NEURONMP_WEIGHTS_DIR"])
    where = env.get("NEURONMP_WEIGHTS_DIR", os.path.join(runtime_dir, "shm"))
    proc = procs.python(_OWNER_KILLED, env=env, stdin=subprocess.PIPE)
    names = json.loads(proc.stdout.readline())
    assert len(names) == 1 and names[0] in os.listdir(where)
    proc.kill()
    proc.wait(timeout=30)
    assert any(names[0] in line for line in leftovers.segments(runtime_dir))
    assert _current_session().pool is not None   # its start swept what dead owners left
    assert names[0] not in os.listdir(where)


def test_dataparallel_replicas_map_the_traced_models_one_copy(emulated):
    emulated("1x4")
    x = torch.randn(8, 512)
    net = Wide().eval()
    traced = neuronmp.trace(net, x[:2])
    dp = neuronmp.DataParallel(traced)
    torch.testing.assert_close(dp(x), net(x))
    pool = _current_session().pool
    (weights,) = pool.shared_weights()   # the trace's and the four replicas' one copy
    maps = {_mapping(pool.worker_pid(core), weights.segment.name)[:3] for core in pool.cores}
    assert len(maps) == 1


class Views(torch.nn.Module):
    """A buffer that is a view into the middle of a bigger storage, a tied weight, and
    a tensor held in a list (not an attribute: it stays in the skeleton)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.b.weight = self.a.weight
        self.register_buffer("row", torch.arange(8.0).reshape(2, 4)[1])
        self.held = [torch.full((4,), 0.25)]

    def forward(self, x):
        return self.b(self.a(x)) + self.row + self.held[0]


@pytest.mark.parametrize("module,width", [(Wide, 512), (Views, 4)], ids=["traced", "scripted"])
def test_weights_read_from_the_archive_are_those_loading_the_graph_finds(module, width,
                                                                           runtime_dir):
    # the coordinator reads the weights out of the archive's entries without loading
    # the graph: same manifest as the loading path's, and the skeleton plus the
    # mapping computes what the module computes
    from neuronmp.pool import archive

    x = torch.randn(2, width)
    data, mod = script_bytes(module().eval(), x if module is Wide else None)
    found = archive.split(memoryview(data))
    assert found is not None
    shared = W.SharedWeights._from_split(data, found)
    try:
        loaded, _storages, size = W._plan(W.load_graph(data))
        assert sorted(shared.manifest) == sorted(loaded)
        assert shared.nbytes >= size
        assert len(shared.skeleton) < 64 << 10
        skeleton = torch.jit.load(io.BytesIO(shared.skeleton))
        mapped = W.MappedWeights(skeleton, *shared.wire(), 0, 1)
        torch.testing.assert_close(skeleton(x), mod(x), rtol=0, atol=0)
        mapped.close()
    finally:
        shared.close()


def test_an_archive_with_compressed_entries_is_loaded_instead(runtime_dir):
    # the reader only copies stored entries; another zip writer's deflated archive
    # still loads in torch, so its weights are shared through the loading path
    from neuronmp.pool import archive

    data, mod = script_bytes(Wide().eval(), torch.randn(2, 512))
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, \
            zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    deflated = out.getvalue()
    assert archive.split(deflated) is None
    shared = W.SharedWeights.publish(deflated)
    assert shared is not None
    try:
        loaded, _storages, _size = W._plan(W.load_graph(data))
        assert sorted(shared.manifest) == sorted(loaded)
    finally:
        shared.close()


_NO_SPACE_FOR_WEIGHTS = textwrap.dedent("""
    import json, os, torch, neuronmp
    from neuronmp.errors import ShmSpaceError
    from neuronmp.session.session import current
    os.environ["NEURONMP_WEIGHTS_DIR"] = "shm"  # 8 MiB would go to the page cache
    pool = current().pool
    shm = os.path.join(os.environ["NEURONMP_RUNTIME_DIR"], "shm")
    before = sorted(os.listdir(shm))
    try:   # 8 MiB of weights, more than the tmpfs holds
        neuronmp.trace(torch.nn.Linear(1024, 2048), torch.zeros(1, 1024))
        first = "loaded"
    except ShmSpaceError as exc:
        first = type(exc).__name__
    info = pool.info(pool.cores[0])
    same = sorted(os.listdir(shm)) == before
    small = neuronmp.trace(torch.nn.Linear(4, 4), torch.zeros(1, 4))
    print(json.dumps({"first": first, "same_files": same, "left": info["models"],
                      "still_serving": small(torch.ones(1, 4)).shape[1]}))
""")


def test_weights_that_do_not_fit_fail_the_load_and_leave_nothing_behind(procs, tmp_path):
    """A 6 MiB tmpfs as the runtime directory (in a private mount namespace, so
    nothing outlives the test): the segment is written without reserving it first,
    and a full filesystem is still a ShmSpaceError, with no file and no model left."""
    got = run_on_a_small_tmpfs(procs, tmp_path, _NO_SPACE_FOR_WEIGHTS, 6)
    assert got == {"first": "ShmSpaceError", "same_files": True, "left": [],
                   "still_serving": 4}, got
