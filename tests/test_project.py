"""Project-level contracts: README <-> CI commands, public API, import direction, no asserts."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

import pytest
from helpers import tracked_files

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytest_plugins = ["pytester"]


def readme_commands() -> list[str]:
    """The commands of the README's first code block (the two set-up commands)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```(?:bash|sh|console)\n(.*?)```", text, re.S)
    if block is None:
        raise AssertionError("README.md has no fenced bash block with the set-up commands")
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_readme_opens_with_two_commands() -> None:
    commands = readme_commands()
    assert len(commands) == 2, commands
    install, tests = commands
    assert "constraints.txt" in install, "the install command must pin torch to the CPU wheel"
    assert "tpsim check tpsim.layers" in install
    assert "pytest" in tests


def test_ci_runs_exactly_the_readme_commands() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in readme_commands():
        assert command in ci, f".ci/run does not run the README command {command!r}"


def test_ci_runs_the_thorough_tier_and_fails_an_empty_one() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'python -m pytest -n auto -m "thorough and not labscale"' in ci.splitlines()
    assert "python -m pytest -m labscale" in ci.splitlines()  # the rest of it, one test at a time
    assert '"$rc" -eq 5' in ci  # pytest's "no tests collected" is a failure, never a pass
    assert "-m 'not thorough'" in (ROOT / "pyproject.toml").read_text()  # the README's command: the fast tier


def test_ci_runs_the_numerics_tests_on_other_cpu_kernels() -> None:
    # MKL's kernels differ by CPU: CI reruns the numerics files on SSE4.2's, between the tiers.
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    (files,) = [line.partition("=")[2].strip('"').split() for line in ci if line.startswith("NUMERICS=")]
    assert files and all((ROOT / f).is_file() and f.startswith("tests/test_") for f in files), files
    command = "MKL_ENABLE_INSTRUCTIONS=SSE4_2 python -m pytest -n auto $NUMERICS"
    assert ci.index("python -m pytest -n auto") < ci.index(command) < ci.index(
        'python -m pytest -n auto -m "thorough and not labscale"')
    assert 'tests_passed "$rc" "the numerics tests under SSE4_2 kernels"' in ci[ci.index(command) + 2]
    assert "MKL_ENABLE_INSTRUCTIONS=SSE4_2" in (ROOT / "README.md").read_text()


@pytest.mark.gloo
def test_a_test_that_starts_gloo_without_the_marker_fails(pytester: pytest.Pytester) -> None:
    # The repository's conftest.py watches every gloo world a test starts in its process.
    pytester.makeconftest((ROOT / "conftest.py").read_text())
    pytester.makepyfile(test_worlds="""
        import pytest, tpsim
        import torch.distributed as dist

        def rank():
            return dist.get_rank()

        def test_unmarked():
            assert tpsim.run(rank, 1, backend="gloo") == [0]

        @pytest.mark.gloo
        def test_marked():
            assert tpsim.run(rank, 1, backend="gloo") == [0]

        def test_inproc():
            assert tpsim.run(rank, 2) == [0, 1]
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-m", "")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*test_unmarked started 1 real gloo world(s)*without the 'gloo' marker*"])


def test_torch_pin_admits_no_newer_release() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"torch>=2\.13,<2\.14"', pyproject)
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text()
    tox = (ROOT / "tox.ini").read_text()
    assert "PIP_CONSTRAINT = {toxinidir}/constraints.txt" in tox


def _locked() -> dict[str, str]:
    """``{normalised name: version}`` of constraints.txt's ``name==version`` lines."""
    from packaging.utils import canonicalize_name

    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"constraints.txt: {line!r} is not an exact pin (name==version)"
            pins[canonicalize_name(name)] = version
    return pins


def _requirements(extras: tuple[str, ...]) -> dict[str, str]:
    """Every distribution ``tpsim[extras]`` needs, transitively: ``{normalised name: who asks}``."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict[str, str] = {}
    todo = [("tpsim", extras, "tpsim")]
    while todo:
        dist, wanted, asker = todo.pop()
        try:
            requires = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            raise AssertionError(f"{dist} (needed by {asker}) is not installed: the tests run in the environment "
                                 f"that `pip install -c constraints.txt -e \".[dev]\"` makes") from None
        for raw in requires:
            req = Requirement(raw)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in ("", *wanted)):
                continue
            name = canonicalize_name(req.name)
            if name not in found:
                found[name] = asker
                todo.append((req.name, tuple(req.extras), name))
    return found


def test_the_lock_pins_everything_the_tests_install() -> None:
    # A fresh machine must run the tests with the versions they were written against (Hypothesis's
    # version changes the example counts the docs show): constraints.txt pins all of tpsim[dev].
    locked = _locked()
    missing = {name: asker for name, asker in _requirements(("dev",)).items() if name not in locked}
    assert not missing, f"constraints.txt does not pin {missing} (regenerate it as its header says)"
    assert locked["torch"] == "2.13.0" and locked["hypothesis"]
    for name in ("deepspeed", "transformers", "torchtitan", "triton", "megatron-core", "fairscale"):
        assert name in locked, name


@pytest.mark.parametrize("module", ["tpsim", "tpsim.layers", "tpsim.faults", "tpsim.mutants", "tpsim.props"])
def test_public_all_resolves(module: str) -> None:
    mod = importlib.import_module(module)
    exported = set(mod.__all__)
    assert len(exported) == len(mod.__all__), "duplicate names in __all__"
    missing = [name for name in exported if not hasattr(mod, name)]
    assert not missing, f"{module}.__all__ names missing attributes: {missing}"


@pytest.mark.parametrize("module", ["tpsim", "tpsim.layers", "tpsim.props"])
def test_package_exports_exactly_all(module: str) -> None:
    # The thin public packages re-export from private modules: everything public is in __all__.
    mod = importlib.import_module(module)
    exported = set(mod.__all__)
    public = {n for n, v in vars(mod).items() if not n.startswith("_") and not isinstance(v, type(ast))}
    public.discard("annotations")
    assert public - exported == set(), f"{module} exposes names missing from __all__: {sorted(public - exported)}"


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_layers_never_import_the_harness() -> None:
    for path in (ROOT / "tpsim" / "layers").rglob("*.py"):
        bad = {n for n in _imports(path) if n.startswith("tpsim") and not n.startswith("tpsim.layers")}
        assert not bad, f"{path.relative_to(ROOT)} imports the harness: {sorted(bad)}"


def test_backends_never_import_layers_or_properties() -> None:
    for path in (ROOT / "tpsim" / "comm").rglob("*.py"):
        bad = {n for n in _imports(path) if n.startswith(("tpsim.layers", "tpsim.props"))}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


#: Hypothesis's public surface tpsim may use: the modules its API reference documents, and of
#: hypothesis.errors (which has no ``__all__``) the exceptions that reference lists, plus
#: ``NoSuchExample``, which ``hypothesis.find`` documents raising. Other modules' names: their ``__all__``.
_HYPOTHESIS_MODULES = ("hypothesis", "hypothesis.strategies", "hypothesis.errors", "hypothesis.database")
_HYPOTHESIS_ERRORS = {"HypothesisException", "HypothesisDeprecationWarning", "Flaky", "FlakyStrategyDefinition",
                      "FlakyFailure", "FlakyBackendFailure", "InvalidArgument", "ResolutionFailed", "Unsatisfiable",
                      "DidNotReproduce", "DeadlineExceeded", "NoSuchExample"}
#: What only Hypothesis's internals use: its engine's test-case data, build context, serialisation of
#: choices and the keys it files examples under beside a test's own.
_HYPOTHESIS_INTERNALS = re.compile(r"hypothesis\.internal|_hypothesis_internal|ConjectureData|BuildContext|"
                                   r"choices_(?:to|from)_bytes|b\"\.(?:secondary|pareto)\"")


def _hypothesis_public(module: str, name: str) -> bool:
    mod = importlib.import_module(module)
    if module == "hypothesis.errors":
        return name in _HYPOTHESIS_ERRORS
    if f"{module}.{name}" in _HYPOTHESIS_MODULES:
        return True
    return name in getattr(mod, "__all__", ())


def _hypothesis_uses(path: pathlib.Path) -> list[tuple[int, str, str]]:
    """``(line, module, name)`` of every Hypothesis name ``path`` imports or reads off a Hypothesis
    module it imported (``hypothesis.seed``, ``st.integers``, ``hypothesis.errors.FlakyFailure``)."""
    tree = ast.parse(path.read_text())
    bound: dict[str, str] = {}  # local name -> the Hypothesis module it is
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "hypothesis":
                    uses.append((node.lineno, a.name, ""))
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else "hypothesis"
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "hypothesis":
            for a in node.names:
                uses.append((node.lineno, node.module, a.name))
                if f"{node.module}.{a.name}" in _HYPOTHESIS_MODULES:
                    bound[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = [node.attr]
            value = node.value
            while isinstance(value, ast.Attribute):
                chain.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                module = bound[value.id]
                for name in chain:  # down the submodules to the first name that is not one
                    uses.append((node.lineno, module, name))
                    if f"{module}.{name}" not in _HYPOTHESIS_MODULES:
                        break
                    module = f"{module}.{name}"
    return uses


def test_the_search_uses_only_hypothesis_public_api() -> None:
    # Hypothesis's internals change between its releases without notice: tpsim (its search, cover phase,
    # seeding and strategies) goes through the documented API alone.
    internals, private = [], []
    for path in sorted((ROOT / "tpsim").rglob("*.py")):
        where = path.relative_to(ROOT)
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if _HYPOTHESIS_INTERNALS.search(line):
                internals.append(f"{where}:{n}: {line.strip()}")
        for lineno, module, name in _hypothesis_uses(path):
            if module not in _HYPOTHESIS_MODULES or (name and not _hypothesis_public(module, name)):
                private.append(f"{where}:{lineno}: {module}{'.' + name if name else ''}")
    assert not internals, "tpsim uses Hypothesis internals:\n" + "\n".join(internals)
    assert not private, "tpsim uses Hypothesis names outside its public API:\n" + "\n".join(private)


def test_the_public_api_check_sees_what_it_must_refuse(tmp_path: pathlib.Path) -> None:
    # The check above, on a file that does everything it must catch (and on one that does not).
    bad = tmp_path / "bad.py"
    bad.write_text("import hypothesis\nimport hypothesis.internal.conjecture.data\n"
                   "from hypothesis import strategies as st\nfrom hypothesis.control import current_build_context\n"
                   "from hypothesis.errors import StopTest\n"
                   "hypothesis.core.find\nst.SearchStrategy\nst._internal\nhypothesis.errors.Found\n")
    uses = _hypothesis_uses(bad)
    refused = {f"{m}.{n}" for _, m, n in uses if m not in _HYPOTHESIS_MODULES or (n and not _hypothesis_public(m, n))}
    assert refused == {"hypothesis.internal.conjecture.data.", "hypothesis.control.current_build_context",
                       "hypothesis.errors.StopTest", "hypothesis.core", "hypothesis.strategies._internal",
                       "hypothesis.errors.Found"}, refused
    assert _HYPOTHESIS_INTERNALS.search("t._hypothesis_internal_use_seed = 1")
    assert _HYPOTHESIS_INTERNALS.search("data = ConjectureData(random=r)")
    assert _HYPOTHESIS_INTERNALS.search('key + b".secondary"')
    good = tmp_path / "good.py"
    good.write_text("import hypothesis\nfrom hypothesis import find, seed, settings\nfrom hypothesis import strategies as st\n"
                    "from hypothesis.errors import NoSuchExample\nhypothesis.seed(1)\nhypothesis.errors.FlakyFailure\n"
                    "st.integers()\n")
    assert all(m in _HYPOTHESIS_MODULES and (not n or _hypothesis_public(m, n)) for _, m, n in _hypothesis_uses(good))


def test_no_assert_statements_in_library_code() -> None:
    # `python -O` strips asserts: input checks must raise real exceptions.
    offenders = []
    for package in ("tpsim",):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Assert):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


def test_readme_documents_every_diagnosis() -> None:
    from tpsim.diagnosis import DIAGNOSES

    readme = (ROOT / "README.md").read_text()
    missing = [name for name in DIAGNOSES if f"`{name}`" not in readme]
    assert not missing, f"README.md does not document the diagnoses {missing}"


def test_readme_has_no_unfilled_placeholders() -> None:
    readme = (ROOT / "README.md").read_text()
    assert not re.findall(r"^[A-Z_]{10,}$", readme, re.M)


# -- the import graph ------------------------------------------------------------------------------

MODULE_LEVEL, FUNCTION_LEVEL, TYPE_ONLY = "module", "function", "type"


def _module_of(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _tpsim_modules() -> dict[str, pathlib.Path]:
    return {_module_of(p): p for p in sorted((ROOT / "tpsim").rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The tpsim modules an import statement imports (``from pkg import sub`` names ``pkg.sub``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "tpsim"]
    base = node.module or ""
    if node.level:  # relative: resolved against this module's package
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    if base.split(".")[0] != "tpsim":
        return []
    found = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        found.append(sub if sub in known else base)
    return found


def import_graph() -> dict[str, dict[str, str]]:
    """``module -> {imported tpsim module: kind}`` for every module of the tpsim package.

    kind is ``module`` (runs when the module is imported, including inside ``try``/``if`` at module
    level and in class bodies), ``function`` (inside a function: runs when it is called) or ``type``
    (under ``if TYPE_CHECKING:``: never runs). A dotted import's parent packages are not edges:
    Python imports them first in any case, so every package ``__init__`` would sit on every cycle.
    A module imported both ways keeps the strongest kind (module > function > type).
    """
    modules = _tpsim_modules()
    known = set(modules)
    graph: dict[str, dict[str, str]] = {}
    for module, path in modules.items():
        edges: dict[str, str] = {}
        _collect(ast.parse(path.read_text()), MODULE_LEVEL, module, path.name == "__init__.py", known, edges)
        graph[module] = edges
    return graph


_STRENGTH = {MODULE_LEVEL: 0, FUNCTION_LEVEL: 1, TYPE_ONLY: 2}


def _collect(node: ast.AST, kind: str, module: str, is_package: bool, known: set[str], edges: dict[str, str]) -> None:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        for target in _targets(node, module, is_package, known):
            if target != module and (target not in edges or _STRENGTH[kind] < _STRENGTH[edges[target]]):
                edges[target] = kind
        return
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and kind == MODULE_LEVEL:
        kind = FUNCTION_LEVEL
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        for child in node.body:
            _collect(child, TYPE_ONLY, module, is_package, known, edges)
        for child in node.orelse:
            _collect(child, kind, module, is_package, known, edges)
        return
    for child in ast.iter_child_nodes(node):
        _collect(child, kind, module, is_package, known, edges)


def format_graph(graph: dict[str, dict[str, str]]) -> str:
    """One line per module: ``a -> b, c, d (fn), e (type)``; ``(fn)``: imported inside a function."""
    mark = {MODULE_LEVEL: "", FUNCTION_LEVEL: " (fn)", TYPE_ONLY: " (type)"}
    order = {MODULE_LEVEL: 0, FUNCTION_LEVEL: 1, TYPE_ONLY: 2}
    lines = []
    for module in sorted(graph):
        edges = sorted(graph[module].items(), key=lambda item: (order[item[1]], item[0]))
        lines.append(f"{module} -> " + (", ".join(f"{t}{mark[k]}" for t, k in edges) or "(nothing)"))
    return "\n".join(lines)


def module_level_cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Every cycle of module-level imports, as one representative path per strongly connected part."""
    adjacency = {m: sorted(t for t, k in edges.items() if k == MODULE_LEVEL) for m, edges in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    parts: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in adjacency.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                parts.append(sorted(part))

    for v in sorted(adjacency):
        if v not in index:
            connect(v)
    cycles = []
    for part in parts:  # a path around the part, for the message
        members = set(part)
        path, v = [part[0]], part[0]
        while True:
            v = next(w for w in adjacency[v] if w in members)
            if v in path:
                cycles.append(path[path.index(v):] + [v])
                break
            path.append(v)
    return cycles


def test_import_graph_is_printed_and_has_no_module_level_cycle() -> None:
    graph = import_graph()
    print("\nimport graph of the tpsim package (module-level imports; (fn): inside a function; "
          "(type): typing only)")
    print(format_graph(graph))
    cycles = module_level_cycles(graph)
    assert not cycles, "module-level import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_import_graph_has_no_cycle_even_through_function_level_imports() -> None:
    # A function-level import only defers a circle: the two modules still depend on each other
    # (the worker pool and torchrun mode once did). Typing-only imports never run and are left out.
    graph = import_graph()
    running = {m: {t: MODULE_LEVEL for t, k in edges.items() if k != TYPE_ONLY} for m, edges in graph.items()}
    cycles = module_level_cycles(running)
    assert not cycles, "import cycles (function-level imports included):\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_import_graph_sees_every_kind_of_import(tmp_path: pathlib.Path) -> None:
    # The graph builder itself can fail: a cycle planted in a copy of a module is found.
    graph = import_graph()
    assert graph["tpsim.runner"]["tpsim.comm.result"] == MODULE_LEVEL
    assert graph["tpsim.runner"]["tpsim.comm.inproc"] == FUNCTION_LEVEL
    planted = {m: dict(e) for m, e in graph.items()}
    planted["tpsim.comm.result"]["tpsim.runner"] = MODULE_LEVEL
    assert ["tpsim.comm.result", "tpsim.runner", "tpsim.comm.result"] in module_level_cycles(planted)


def test_backends_never_import_the_runner() -> None:
    # The runner dispatches to the backends; a backend importing it back was the old circle.
    graph = import_graph()
    for module, edges in graph.items():
        if module.startswith("tpsim.comm."):
            assert "tpsim.runner" not in edges, f"{module} imports tpsim.runner ({edges['tpsim.runner']}-level)"


def test_only_tpsim_is_installed_top_level(tmp_path: pathlib.Path) -> None:
    import shutil
    import subprocess
    import sys
    import zipfile

    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    assert set(include) == {"tpsim", "tpsim.*"}, include
    # Build the wheel from a copy of the tracked files (a build writes build/ and *.egg-info next to
    # the sources; a venv inside the checkout is not the project's), which keeps every top-level
    # directory a stray package could come from.
    src = tmp_path / "src"
    for path in tracked_files(ROOT):
        (src / path.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, src / path.relative_to(ROOT))
    assert (src / "properties").is_dir() and (src / "tests").is_dir() and (src / "tools").is_dir()
    out = tmp_path / "wheel"
    proc = subprocess.run(
        [sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.build_wheel({str(out)!r}))"],
        cwd=src, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    wheel = out / proc.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        assert zf.read(top_level).decode().split() == ["tpsim"]
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"tpsim"}, tops
    assert not [n for n in names if n.startswith("tpsim/docs/")], "the docs tooling lives in tools/, uninstalled"


if __name__ == "__main__":  # python tests/test_project.py prints the import graph
    print(format_graph(import_graph()))
