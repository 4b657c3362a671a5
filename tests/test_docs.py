"""The documentation against the code: docs/reference.md, the README, the MkDocs site.

    neuronmp/**/*.py, _neuronmp_provide.py --ast--> names the package reads --+
    docs/reference.md "Environment variables" table ------------------------> equal?
        the same table (less _NOT_SETTINGS) --> settings.VARIABLES: equal; each
        variable's good value changes its field, its bad value is a ConfigError naming it
    each CLI's argparse parser --option strings--> its section of the reference: equal?
    mkdocs build --strict -----------------------> passes (skipped without mkdocs)

The variable names come from the source itself: every string constant (or keyword
argument name) of the NEURON / NEURONMP namespaces, so a new ``os.environ.get(
"NEURONMP_X")`` or ``envconfig.seconds("NEURON_RT_X", ...)`` fails here until the
reference lists it.  Names outside those namespaces (torchrun's, the temp and runtime
directories') are listed in _OTHER_READS, each of which must still be in the code.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Set

import pytest

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference.md"
README = ROOT / "README.md"

#: the namespaces scanned for whole-string constants
_NAMESPACE = re.compile(r"^(?:NEURON(?:MP|_RT|_LOGICAL)?|TORCH_NEURONX)_[A-Z0-9_]+$")
#: variables outside those namespaces that the package reads (a trailing _ is a prefix)
_OTHER_READS = {"LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_ERROR_FILE",
                "OMP_NUM_THREADS", "XDG_RUNTIME_DIR", "XDG_CACHE_HOME", "TMPDIR", "TEMP", "TMP",
                "CXX", "PET_"}
#: each command's heading in the reference, and how to build its parser
_PARSERS = {
    "neuronmp-run": ("neuronmp.cli.run", "build_parser"),
    "neuronmp-ls": ("neuronmp.cli.ls", "_parser"),
    "neuronmp-top": ("neuronmp.cli.top", "_parser"),
    "neuronmp-monitor": ("neuronmp.cli.monitor", "_parser"),
    "neuronmp-serve": ("neuronmp.server.__main__", "_parser"),
}


def _package_sources() -> List[Path]:
    return sorted((ROOT / "neuronmp").rglob("*.py")) + [ROOT / "_neuronmp_provide.py"]


def _constants(paths: Iterable[Path]) -> Dict[str, Set[str]]:
    """Every string constant and keyword-argument name in ``paths``, with its files."""
    found: Dict[str, Set[str]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.setdefault(node.value, set()).add(str(path))
            elif isinstance(node, ast.keyword) and node.arg:
                found.setdefault(node.arg, set()).add(str(path))
    return found


def variables_read(paths: Iterable[Path]) -> Set[str]:
    """The environment variable names the sources read (prefixes end in _)."""
    names = {name for name in _constants(paths) if _NAMESPACE.match(name)}
    return names | _OTHER_READS


def _section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section of a Markdown text."""
    match = re.search(rf"^## {re.escape(heading)}\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"docs/reference.md has no '## {heading}' section"
    return match.group(1)


def _first_cells(section: str) -> List[str]:
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and not ln.startswith("|--")]
    return [row.split("|")[1] for row in rows[1:]]   # rows[0] is the header


def documented_variables(text: str) -> Set[str]:
    """The variables the reference's table lists (``X_<OPTION>`` is the prefix ``X_``)."""
    names = set()
    for cell in _first_cells(_section(text, "Environment variables")):
        for name in re.findall(r"`([A-Z][A-Z0-9_]*(?:<OPTION>)?)`", cell):
            names.add(name.replace("<OPTION>", ""))
    return names


def _missing_and_stale(code: Set[str], docs: Set[str]) -> str:
    return (f"read by the code but not in docs/reference.md: {sorted(code - docs)}; "
            f"in docs/reference.md but not read by the code: {sorted(docs - code)}")


def test_reference_lists_exactly_the_variables_the_package_reads():
    code = variables_read(_package_sources())
    docs = documented_variables(REFERENCE.read_text())
    assert code == docs, _missing_and_stale(code, docs)


def test_each_listed_outside_variable_is_still_in_the_code():
    constants = _constants(_package_sources())
    gone = sorted(name for name in _OTHER_READS if name not in constants)
    assert not gone, f"_OTHER_READS names no longer in the package: {gone}"


def test_a_variable_added_to_the_code_alone_is_caught(tmp_path):
    """The check above, on the package plus one module reading a new variable."""
    extra = tmp_path / "extra.py"
    extra.write_text('import os\nKNOB = os.environ.get("NEURONMP_UNDOCUMENTED_KNOB", "1")\n')
    code = variables_read(_package_sources() + [extra])
    docs = documented_variables(REFERENCE.read_text())
    assert code - docs == {"NEURONMP_UNDOCUMENTED_KNOB"}, _missing_and_stale(code, docs)


# -- the table against the settings object --------------------------------------------------

#: documented variables the settings object does not parse, and why
_NOT_SETTINGS = {
    "NEURONMP_RUN_", "PET_",       # neuronmp-run's options: its argparse parser reads them
    "OMP_NUM_THREADS",             # set for each rank by neuronmp-run when unset, never read
}
_BASE = {"NEURONMP_TOPOLOGY": "4x4"}
#: variable -> (a good value that changes its field, a bad value), each on top of _BASE
_CASES = {
    "NEURONMP_TOPOLOGY": ({"NEURONMP_TOPOLOGY": "2x2"}, {"NEURONMP_TOPOLOGY": "warp-9"}),
    "NEURON_LOGICAL_NC_CONFIG": ({"NEURON_LOGICAL_NC_CONFIG": "2"},
                                 {"NEURON_LOGICAL_NC_CONFIG": "3"}),
    "NEURON_RT_VISIBLE_CORES": ({"NEURON_RT_VISIBLE_CORES": "1-2"},
                                {"NEURON_RT_VISIBLE_CORES": "3,5"}),
    "NEURON_RT_NUM_CORES": ({"NEURON_RT_NUM_CORES": "2"}, {"NEURON_RT_NUM_CORES": "two"}),
    "LOCAL_RANK": ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
                   {"LOCAL_RANK": "first", "LOCAL_WORLD_SIZE": "2"}),
    "LOCAL_WORLD_SIZE": ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"},
                         {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "all"}),
    "NEURONMP_SLICED_BY": ({"NEURONMP_SLICED_BY": "neuronmp-run"},
                           {"NEURONMP_SLICED_BY": "two words"}),
    "NEURON_RT_EXEC_TIMEOUT": ({"NEURON_RT_EXEC_TIMEOUT": "5"},
                               {"NEURON_RT_EXEC_TIMEOUT": "soon"}),
    "NEURON_RT_ROOT_COMM_ID": ({"NEURON_RT_ROOT_COMM_ID": "10.0.0.1:62182"},
                               {"NEURON_RT_ROOT_COMM_ID": "10.0.0.1:99999"}),
    "NEURONMP_RUNTIME_DIR": ({"NEURONMP_RUNTIME_DIR": "{dir}"},
                             {"NEURONMP_RUNTIME_DIR": "{file}"}),
    "NEURONMP_RESERVE_TIMEOUT": ({"NEURONMP_RESERVE_TIMEOUT": "2"},
                                 {"NEURONMP_RESERVE_TIMEOUT": "forever"}),
    "NEURONMP_RING_BYTES": ({"NEURONMP_RING_BYTES": "1MiB"}, {"NEURONMP_RING_BYTES": "8MB"}),
    "NEURONMP_WORKER_START_TIMEOUT": ({"NEURONMP_WORKER_START_TIMEOUT": "5"},
                                      {"NEURONMP_WORKER_START_TIMEOUT": "0"}),
    "NEURONMP_WAIT_SPIN_US": ({"NEURONMP_WAIT_SPIN_US": "10"}, {"NEURONMP_WAIT_SPIN_US": "-1"}),
    "NEURONMP_WORKER_SPIN_US": ({"NEURONMP_WORKER_SPIN_US": "10"},
                                {"NEURONMP_WORKER_SPIN_US": "1e3"}),
    "NEURONMP_WORKER_KEEP_MB": ({"NEURONMP_WORKER_KEEP_MB": "0"},
                                {"NEURONMP_WORKER_KEEP_MB": "lots"}),
    "NEURONMP_IPC_SPIN_US": ({"NEURONMP_IPC_SPIN_US": "100"},
                             {"NEURONMP_IPC_SPIN_US": "20000"}),
    "NEURONMP_IPC_PAUSE_US": ({"NEURONMP_IPC_PAUSE_US": "5"}, {"NEURONMP_IPC_PAUSE_US": "x"}),
    "NEURONMP_SHARE_WEIGHTS": ({"NEURONMP_SHARE_WEIGHTS": "0"}, {"NEURONMP_SHARE_WEIGHTS": "2"}),
    "NEURONMP_SHM_MAX_REGIONS": ({"NEURONMP_SHM_MAX_REGIONS": "8"},
                                 {"NEURONMP_SHM_MAX_REGIONS": "0"}),
    "NEURONMP_WEIGHTS_DIR": ({"NEURONMP_WEIGHTS_DIR": "shm"},
                             {"NEURONMP_WEIGHTS_DIR": "relative/dir"}),
    "NEURONMP_COLLECTIVE_SLOT_KB": ({"NEURONMP_COLLECTIVE_SLOT_KB": "64"},
                                    {"NEURONMP_COLLECTIVE_SLOT_KB": "32"}),
    "NEURONMP_COLLECTIVE_SPIN_US": ({"NEURONMP_COLLECTIVE_SPIN_US": "300"},
                                    {"NEURONMP_COLLECTIVE_SPIN_US": "200001"}),
    "NEURONMP_DEVICE_TIME_US": ({"NEURONMP_DEVICE_TIME_US": "500,20"},
                                {"NEURONMP_DEVICE_TIME_US": "fast"}),
    "NEURONMP_PROVIDE": ({"NEURONMP_PROVIDE": "torch_neuronx"},
                         {"NEURONMP_PROVIDE": "torch_cuda"}),
    "NEURONMP_TORCHNEURON_CACHE": ({"NEURONMP_TORCHNEURON_CACHE": "{dir}"},
                                   {"NEURONMP_TORCHNEURON_CACHE": "{file}"}),
    "NEURONMP_TORCHNEURON_RELAXED": ({"NEURONMP_TORCHNEURON_RELAXED": "1"},
                                     {"NEURONMP_TORCHNEURON_RELAXED": "yes"}),
    "NEURON_PROCESS_TAG": ({"NEURON_PROCESS_TAG": "my_app_1"},
                           {"NEURON_PROCESS_TAG": "two\nlines"}),
    "GROUP_RANK": ({"GROUP_RANK": "1"}, {"GROUP_RANK": "-1"}),
    "TORCH_NEURONX_ATEN_GMM_ALIGN": ({"TORCH_NEURONX_ATEN_GMM_ALIGN": "64"},
                                     {"TORCH_NEURONX_ATEN_GMM_ALIGN": "wide"}),
    # no bad value: a path, a command, directories a missing one of which is skipped
    # (XDG_CACHE_HOME: a relative one, as the XDG spec says), and TorchNeuron's
    # switches, which take any value as TorchNeuron does ("1" on, else off)
    "TORCHELASTIC_ERROR_FILE": ({"TORCHELASTIC_ERROR_FILE": "{dir}/error.json"}, None),
    "XDG_RUNTIME_DIR": ({"XDG_RUNTIME_DIR": "{dir}"}, None),
    "XDG_CACHE_HOME": ({"XDG_CACHE_HOME": "{dir}"}, None),
    "TMPDIR": ({"TMPDIR": "{dir}"}, None),
    "TEMP": ({"TEMP": "{dir}"}, None),
    "TMP": ({"TMP": "{dir}"}, None),
    "CXX": ({"CXX": "clang++"}, None),
    "TORCH_NEURONX_MLIR_ATEN_OPS": ({"TORCH_NEURONX_MLIR_ATEN_OPS": "1"}, None),
    "TORCH_NEURONX_ENABLE_STABLEHLO": ({"TORCH_NEURONX_ENABLE_STABLEHLO": "0"}, None),
    "NEURON_LAUNCH_BLOCKING": ({"NEURON_LAUNCH_BLOCKING": "1"}, None),
    "TORCH_NEURONX_SKIP_OP_PRECONDITIONS": ({"TORCH_NEURONX_SKIP_OP_PRECONDITIONS": "1"}, None),
    "TORCH_NEURONX_DISABLE_NEFF_CACHE": ({"TORCH_NEURONX_DISABLE_NEFF_CACHE": "yes"}, None),
    "TORCH_NEURONX_DYNAMO_DISABLE_CPU_AUTOCOPY": (
        {"TORCH_NEURONX_DYNAMO_DISABLE_CPU_AUTOCOPY": "1"}, None),
    "TORCH_NEURONX_RETAIN_DEVICE_MODE": ({"TORCH_NEURONX_RETAIN_DEVICE_MODE": "1"}, None),
}


def _env(case: Dict[str, str], tmp_path: Path) -> Dict[str, str]:
    (tmp_path / "file").write_text("")
    filled = {k: v.format(dir=tmp_path, file=tmp_path / "file") for k, v in case.items()}
    return dict(_BASE, **filled)


def test_the_settings_object_parses_exactly_the_documented_variables():
    from neuronmp.host import settings

    documented = documented_variables(REFERENCE.read_text()) - _NOT_SETTINGS
    assert set(settings.VARIABLES) == documented, _missing_and_stale(
        set(settings.VARIABLES), documented)
    assert set(_CASES) == documented, "give each documented variable a good and a bad value"
    assert set(settings.VARIABLES.values()) == {f.name for f in
                                                 dataclasses.fields(settings.Settings)}


@pytest.mark.parametrize("variable", sorted(_CASES))
def test_each_documented_variable_is_parsed_by_the_settings_object(variable, tmp_path):
    from neuronmp.host import settings

    good, _ = _CASES[variable]
    field = settings.VARIABLES[variable]
    default = settings.parse_field(field, _BASE)
    assert getattr(settings.parse(_env(good, tmp_path)), field) != default


# a variable any text is good for (a path, a tag) has no bad value to try
@pytest.mark.parametrize("variable", sorted(v for v, (_, bad) in _CASES.items() if bad))
def test_a_bad_value_of_each_documented_variable_is_a_config_error_naming_it(variable,
                                                                            tmp_path):
    from neuronmp.errors import ConfigError
    from neuronmp.host import settings

    env = _env(_CASES[variable][1], tmp_path)
    with pytest.raises(ConfigError) as info:
        settings.parse(env)
    assert info.value.variable == variable
    assert repr(env[variable]) in str(info.value) and info.value.accepted


def test_each_documented_default_is_the_settings_default():
    """A default cell holding one value (`8MiB`, `auto`) parses to what an unset
    variable gives; cells that describe (`one core per CPU`, paths with <uid>) are
    left to the prose."""
    from neuronmp.host import settings

    checked = []
    rows = _section(REFERENCE.read_text(), "Environment variables").splitlines()
    for row in rows:
        cells = row.split("|")
        names = re.findall(r"`([A-Z][A-Z0-9_]*)`", cells[1]) if len(cells) > 3 else []
        values = re.findall(r"`([^`]*)`", cells[2]) if names else []
        if len(names) != 1 or names[0] not in settings.VARIABLES or len(values) != 1 \
                or re.search(r"[<$]", values[0]) or values[0] in settings.VARIABLES:
            continue
        field = settings.VARIABLES[names[0]]
        documented = settings.parse_field(field, dict(_BASE, **{names[0]: values[0]}))
        assert documented == settings.parse_field(field, _BASE), (names[0], values[0])
        checked.append(names[0])
    assert len(checked) >= 14, checked   # the single-valued defaults today


def test_settings_accept_the_names_the_start_up_hook_accepts():
    import _neuronmp_provide
    from neuronmp.host import settings

    assert settings.PROVIDE_ACCEPTED == _neuronmp_provide.ACCEPTED


def documented_options(text: str, command: str) -> Set[str]:
    options = set()
    for cell in _first_cells(_section(text, command)):
        options.update(re.findall(r"`(--?[A-Za-z][A-Za-z0-9_-]*)`", cell))
    return options


@pytest.mark.parametrize("command", sorted(_PARSERS))
def test_reference_lists_every_option_of_each_command(command):
    module, function = _PARSERS[command]
    parser = getattr(importlib.import_module(module), function)()
    assert parser.prog == command
    accepted = {opt for action in parser._actions for opt in action.option_strings}
    docs = documented_options(REFERENCE.read_text(), command)
    assert accepted == docs, (f"{command}: options not in docs/reference.md: "
                              f"{sorted(accepted - docs)}; documented but gone: "
                              f"{sorted(docs - accepted)}")


def test_python_m_neuronmp_takes_no_options_as_the_reference_says():
    source = (ROOT / "neuronmp" / "__main__.py").read_text()
    names = {n.attr if isinstance(n, ast.Attribute) else n.id
             for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.Attribute, ast.Name))}
    assert not names & {"ArgumentParser", "argv"}, "python -m neuronmp grew options: document them"
    assert "It takes no options" in _section(REFERENCE.read_text(), "`python -m neuronmp`")


def test_readme_is_a_short_user_document_with_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    first_block = text.split("```\n")[1]
    assert first_block.splitlines() == [
        "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e . "
        "&& python -m neuronmp",
        "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e "
        "'.[test]' && python -m pytest -q -n 2 --dist loadfile",
    ]


@pytest.mark.parametrize("page", ["README.md", "DESIGN.md"])
def test_relative_links_of_the_root_pages_resolve(page):
    text = (ROOT / page).read_text()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)]+)\)", text)
               if "://" not in t and not t.startswith("#")]
    assert targets, f"{page} links to no documentation page"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"{page} links to files that do not exist: {missing}"


def test_mkdocs_build_strict_passes(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]'")
    pytest.importorskip("material", reason="mkdocs-material is not installed: "
                                           "pip install -e '.[docs]'")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                          "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "site" / "reference" / "index.html").exists()


DATA = ROOT / "docs" / "data"


def test_each_recorded_figure_has_its_plot_on_the_performance_page():
    page = (ROOT / "docs" / "performance.md").read_text()
    names = sorted(p.stem for p in DATA.glob("*.json"))
    assert names, "no recorded figures in docs/data"
    for name in names:
        assert (ROOT / "docs" / "img" / f"{name}.png").exists(), name
        assert f"(img/{name}.png)" in page, f"performance.md does not show img/{name}.png"


def test_the_recorded_serving_figures_are_the_tables():
    """The plot's numbers are the table's: each (clients, req/s, p99) row is in the page."""
    import json

    page = (ROOT / "docs" / "performance.md").read_text()
    fig = json.loads((DATA / "serving-peers.json").read_text())
    for name, series in fig["series"].items():
        for clients, rps, p99 in zip(fig["clients"], series["rps"], series["p99_ms"]):
            row = re.search(rf"\| {clients} \| {rps} \| [0-9.]+ \| {p99:.2f} \|", page)
            assert row, f"{name}, {clients} clients: {rps} req/s, p99 {p99} not in the table"


def test_plot_recorded_redraws_every_docs_plot(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: "
                                             "pip install -e '.[bench]'")
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_recorded.py"),
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    drawn = sorted(p.stem for p in tmp_path.glob("*.png"))
    assert drawn == sorted(p.stem for p in DATA.glob("*.json"))
    assert all(p.stat().st_size > 10_000 for p in tmp_path.glob("*.png"))


def test_reference_lists_exactly_the_error_classes():
    import inspect

    from neuronmp import errors
    from neuronmp.server import errors as server_errors

    code = {name for module in (errors, server_errors) for name, obj in vars(module).items()
            if inspect.isclass(obj) and issubclass(obj, BaseException)
            and obj.__module__ == module.__name__}
    docs = set()
    for cell in _first_cells(_section(REFERENCE.read_text(), "Errors")):
        docs.update(re.findall(r"`([A-Za-z]+)`", cell))
    assert code == docs, (f"in the errors modules but not in the reference: {sorted(code - docs)}; "
                          f"in the reference but gone: {sorted(docs - code)}")


# -- the README's examples, run as the README says ------------------------------------

def _code_blocks(text: str, lang: str) -> List[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)


def _run_as_told(block: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Save a block headed ``# NAME, run with: [VAR=VALUE ...] python ...`` and run it so."""
    import shlex

    name, command = re.match(r"# (\S+), run with: (.*)", block.splitlines()[0]).groups()
    (cwd / name).write_text(block)
    words = shlex.split(command)
    env = dict(os.environ)
    while "=" in words[0]:
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    assert words[0] == "python", command
    return subprocess.run([sys.executable] + words[1:], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _readme_block(start: str) -> str:
    blocks = [b for b in _code_blocks(README.read_text(), "python") if b.startswith(start)]
    assert len(blocks) == 1, f"README: {len(blocks)} python blocks start with {start!r}"
    return blocks[0]


@pytest.mark.parametrize("name, printed", [
    ("dp.py", "(0, 1)"), ("sdk.py", "torch.Size([1, 2])"), ("test_split.py", "1 passed"),
    ("tn.py", "2 neuron:1"),
])
def test_readme_example_runs_as_the_readme_says(tmp_path, name, printed):
    res = _run_as_told(_readme_block(f"# {name}, run with:"), tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert printed in res.stdout


def test_readme_neuronmp_run_example_prints_what_the_readme_shows(tmp_path):
    text = README.read_text()
    (tmp_path / "show.py").write_text(_readme_block("# show.py"))
    console = re.search(r"^```\n(\$ NEURONMP_TOPOLOGY=.*?)^```", text, re.M | re.S).group(1)
    command, *shown = console.splitlines()
    env_word, *argv = command[2:].split()
    assert argv[0] == "neuronmp-run"
    res = subprocess.run([sys.executable, "-m", "neuronmp.cli.run"] + argv[1:], cwd=tmp_path,
                         env=dict(os.environ, **dict([env_word.split("=")])),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    want = sorted(line.split("#")[0].rstrip() for line in shown)
    assert sorted(res.stdout.splitlines()) == want


def test_readme_serving_example_answers_through_tritonclient(tmp_path, procs):
    pytest.importorskip("aiohttp", reason="neuronmp-serve needs the serve extra")
    pytest.importorskip("tritonclient.http", reason="the example's client: tritonclient[http]")
    import socket
    import time
    import urllib.request

    make = _readme_block("import os, torch, neuronmp\nnet = torch.nn.Sequential(torch.nn.Linear(16")
    made = subprocess.run([sys.executable, "-c", make], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = procs.popen([sys.executable, "-m", "neuronmp.serve", "--model-repository",
                          "models", "--http-port", str(port), "--grpc-port", "0",
                          "--metrics-port", "0", "--host", "127.0.0.1"], cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while True:
        assert server.poll() is None, server.stdout.read()
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready",
                                      timeout=2).status == 200:
                break
        except OSError:
            assert time.monotonic() < deadline, "neuronmp-serve not ready in 120 s"
            time.sleep(0.2)
    client = _readme_block("import numpy as np\nimport tritonclient.http")
    res = subprocess.run([sys.executable, "-c", client.replace("localhost:8000",
                                                               f"127.0.0.1:{port}")],
                         capture_output=True, text=True, timeout=120)
    server.terminate()
    assert server.wait(timeout=60) == 0
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "(1, 4)"


def test_the_site_home_is_the_readme_with_site_links():
    """docs/index.md is the README, its docs/ links made relative to the site."""
    readme = README.read_text().replace("](docs/", "](")
    home = (ROOT / "docs" / "index.md").read_text()
    differ = [(a, b) for a, b in zip(readme.splitlines(), home.splitlines()) if a != b]
    assert len(readme.splitlines()) == len(home.splitlines())
    assert len(differ) <= 2, differ   # only the paragraph on how to read the docs


def test_code_that_cites_the_performance_page_names_one_of_its_sections():
    """A comment citing docs/performance.md names a heading the page has: the page is
    rewritten as figures change, and a citation of a section it no longer has sends
    the reader nowhere."""
    headings = {line.lstrip("#").strip() for line in
                (ROOT / "docs" / "performance.md").read_text().splitlines()
                if line.startswith("#")}
    cited, bare = [], []
    for path in sorted((ROOT / "neuronmp").rglob("*")):
        if path.suffix not in (".py", ".c", ".h", ".cpp"):
            continue
        # comments wrap lines: a citation is read with its lines joined
        text = re.sub(r"\s*\n\s*(?:#|\*)?\s*", " ", path.read_text())
        for m in re.finditer(r"docs/performance\.md(,? \"([^\"]+)\")?", text):
            where = path.relative_to(ROOT)
            (cited if m.group(2) else bare).append((where, m.group(2)))
    assert cited, "no citation of docs/performance.md found: the pattern is wrong"
    assert not bare, f"cite a section by its heading: {bare}"
    unknown = [(str(w), h) for w, h in cited if h not in headings]
    assert not unknown, f"sections docs/performance.md does not have: {unknown}"
