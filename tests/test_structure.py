"""The package's shape: no import cycle, no oversized module, a daemon free of UI libraries.

The import graph is read from the source with `ast`, so that it sees every import: those at
module level, inside functions, and under `if TYPE_CHECKING:` (a cycle hidden from the
interpreter is still a cycle for a reader). Edges are resolved as Python resolves them:

- `import shadefs.a.b` and `from shadefs.a import b` (b a module) import shadefs.a.b;
  `from shadefs.a.b import name` (name not a module) imports shadefs.a.b;
- importing shadefs.a.b runs the package `__init__` of shadefs.a first, so it is an edge to
  shadefs.a too (and a package's `__init__` is a module like any other).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "shadefs"
MAX_LINES = 450
# Modules past MAX_LINES that were looked at and own one concept, which splitting would
# only scatter (docs/design.md §9: one concept stays whole), up to ONE_CONCEPT_MAX lines.
ONE_CONCEPT = {
    "shadefs/fs/operations.py": "the pyfuse3 request handlers, one per request type",
    "shadefs/fs/namespace.py": "inode <-> path: the table, snapshots, a node's version",
    "shadefs/stats.py": "the one typed stats schema and its JSON form",
    "shadefs/cache/coordinator.py": "the RAM tier: its entries, single flight, hits, accounting",
    "shadefs/prefetch/prefetcher.py": "the staging buffer and the scheduler that fills it",
    "shadefs/readers/tracker.py": "the one epoch tracker: reads, epochs, demand, one or many",
}
ONE_CONCEPT_MAX = 800
UI_LIBRARIES = ("rich", "tqdm", "matplotlib", "torch", "PIL")


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules that module `name` imports, anywhere in its source."""
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets.add(mod)
            targets.update(f"{mod}.{alias.name}" for alias in node.names)
    found = set()
    for target in targets:
        if target in modules:
            found.add(target)
            found.update(a for a in _ancestors(target) if a in modules)
    found.discard(name)
    # A module's own package is initialised before it: that is not a dependency it chose.
    return found - set(_ancestors(name))


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The components of more than one module (Tarjan): each one holds a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One concrete cycle per strongly connected component."""
    return [_cycle_in(graph, set(comp)) for comp in strongly_connected(graph)]


def _cycle_in(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A concrete cycle through the first module of a strongly connected component."""
    start = min(comp)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in component {sorted(comp)}")


def test_the_graph_sees_every_kind_of_import() -> None:
    """The walker itself: TYPE_CHECKING, function-level, relative and package imports."""
    graph = import_graph()
    assert "shadefs.cli.commands" in graph["shadefs.cli"]  # a package __init__ is a module
    assert "shadefs.daemon" in graph["shadefs.cli.commands"]  # imported inside a function
    assert "shadefs.sampling.wire" in graph["shadefs.torch.sampler"]  # `from pkg import mod`
    assert "shadefs.sampling" in graph["shadefs.torch.sampler"]  # its package runs first
    cyclic = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(cyclic) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle() -> None:
    graph = import_graph()
    report = [
        f"  {' -> '.join(_cycle_in(graph, set(comp)))}\n    (all tangled: {', '.join(comp)})"
        for comp in strongly_connected(graph)
    ]
    assert not report, (
        "import cycles in shadefs/ (TYPE_CHECKING and function-level imports count):\n"
        + "\n".join(report)
    )


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between the package's parts: each module stands for its subpackage
    of shadefs (shadefs.cache.blocks is shadefs.cache), a top-level module for itself. A
    part that imports another, which imports it back through other modules, is a cycle
    no module cycle shows."""

    def part(name: str) -> str:
        return ".".join(name.split(".")[:2])

    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        edges = out.setdefault(part(module), set())
        edges.update(part(t) for t in targets if part(t) != part(module) and t != "shadefs")
    return out


def test_the_package_graph_sees_a_cycle_between_parts() -> None:
    graph = {"shadefs.a.x": {"shadefs.b.y"}, "shadefs.b.z": {"shadefs.a.w"}, "shadefs.c": set()}
    assert find_cycles(package_graph(graph)) == [["shadefs.a", "shadefs.b", "shadefs.a"]]


def test_no_import_cycle_between_parts() -> None:
    graph = package_graph(import_graph())
    report = [f"  {' -> '.join(_cycle_in(graph, set(c)))}" for c in strongly_connected(graph)]
    assert not report, "import cycles between the parts of shadefs/:\n" + "\n".join(report)


_UP = ("shadefs.service", "shadefs.daemon")  # the owner of the parts, and its process
# What each part may not import, even under TYPE_CHECKING: data flows fs -> cache -> source,
# control sees the daemon only through its own Protocol, and no part reaches up to the
# object that owns it.
FORBIDDEN = {
    "shadefs.source": ("shadefs.fs", "shadefs.cache", "shadefs.control", *_UP),
    "shadefs.cache": ("shadefs.fs", "shadefs.control", *_UP),
    # Planning over the readers' state; told what to fetch, never serving or evicting.
    "shadefs.prefetch": ("shadefs.fs", "shadefs.control", "shadefs.cache.coordinator", *_UP),
    # Who reads what: below the cache and beside sampling, above nothing but stats.
    "shadefs.readers": (
        "shadefs.fs",
        "shadefs.cache",
        "shadefs.prefetch",
        "shadefs.sampling",
        "shadefs.control",
        "shadefs.source",
        *_UP,
    ),  # fmt: skip
    "shadefs.sampling": ("shadefs.fs", "shadefs.cache", "shadefs.control", *_UP),
    "shadefs.fs": _UP,
    "shadefs.control": ("shadefs.fs", "shadefs.cache", *_UP),
    "shadefs.stats": ("shadefs.source", "shadefs.fs", "shadefs.cache", "shadefs.control", *_UP),
    # What the daemon tells or asks the kernel: a leaf, under every part that needs it.
    "shadefs.kernel": (
        "shadefs.fs",
        "shadefs.cache",
        "shadefs.prefetch",
        "shadefs.readers",
        "shadefs.sampling",
        "shadefs.control",
        "shadefs.source",
        *_UP,
    ),  # fmt: skip
}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_parts_import_only_downstream() -> None:
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for part, forbidden in FORBIDDEN.items()
        if _within(module, part)
        for target in targets
        if any(_within(target, f) for f in forbidden)
    )
    assert not wrong, "imports against the data flow (fs -> cache -> source):\n  " + (
        "\n  ".join(wrong)
    )


# The prefetch part (a known order's plans, the prefetcher, speculation) is told what to fetch
# and asks the cache through the callables and Protocols it is handed: it never imports the
# coordinator, which owns it.
PREFETCH_PART = (
    "shadefs.prefetch.fetching",
    "shadefs.prefetch.plans",
    "shadefs.prefetch.prefetcher",
    "shadefs.prefetch.spec_plans",
    "shadefs.prefetch.speculate",
)


def _reach(graph: dict[str, set[str]], start: str) -> dict[str, list[str]]:
    """Every module `start` imports, directly or through others: the path to each."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        v = frontier.pop()
        for w in sorted(graph.get(v, ())):
            if w not in paths:
                paths[w] = paths[v] + [w]
                frontier.append(w)
    return paths


def test_the_prefetch_part_never_imports_the_coordinator() -> None:
    graph = import_graph()
    assert all(module in graph for module in PREFETCH_PART)
    coordinator = "shadefs.cache.coordinator"
    wrong = [
        " -> ".join(path)
        for m in PREFETCH_PART
        for target, path in _reach(graph, m).items()
        if target == coordinator
    ]
    assert not wrong, "the prefetch part imports the coordinator:\n  " + "\n  ".join(wrong)
    # The walk sees an edge through another module: the test can fail.
    assert _reach({"a": {"b"}, "b": {coordinator}}, "a")[coordinator] == ["a", "b", coordinator]


# The file system sees the cache through its face (cache/face.py): one `open` whose result
# says where the bytes are, the hit path's `reopen`, and the types of what an open returns.
# It never reaches the coordinator, the tiers or blocks, nor shares their state.
CACHE_FACE = {"shadefs.cache.face", "shadefs.cache.deferred", "shadefs.cache.block_handle"}


def test_fs_sees_the_cache_only_through_its_face() -> None:
    graph = import_graph()
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if _within(module, "shadefs.fs")
        for target in targets
        if _within(target, "shadefs.cache") and target not in CACHE_FACE | {"shadefs.cache"}
    )
    assert not wrong, "fs past the cache's face:\n  " + "\n  ".join(wrong)
    assert graph["shadefs.fs.operations"] & CACHE_FACE  # (the walk sees fs's cache imports)


def test_no_module_over_the_line_limit() -> None:
    long = {
        str(path.relative_to(PACKAGE.parent)): n
        for path in sorted(PACKAGE.rglob("*.py"))
        if (n := len(path.read_text().splitlines()))
        > (ONE_CONCEPT_MAX if str(path.relative_to(PACKAGE.parent)) in ONE_CONCEPT else MAX_LINES)
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by what they own): {long}"


def test_the_daemon_imports_no_ui_library() -> None:
    code = "import shadefs.daemon, sys; print('\\n'.join(sorted(sys.modules)))"
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    loaded = set(res.stdout.split())
    found = sorted(m for m in loaded if m.split(".")[0] in UI_LIBRARIES)
    assert not found, f"importing shadefs.daemon loads UI libraries or torch: {found}"


# A file named in a comment or docstring: a path ending in one of these suffixes.
_CITED = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.(?:py|md|sh|patch|toml))\b")
REPO = PACKAGE.parent
# Files of other projects that comments name (pyfuse3's, S3QL's, trio's).
_ELSEWHERE = {"fs.py", "_run.py", "handlers.pxi", "mount.py", "block_cache.md", "module.py"}


def _exists(ref: str, near: Path, names: set[str]) -> bool:
    """Whether `ref`, cited in file `near`, is a file of the repository: as a path from the
    repository, the package, docs/, tools/ or tests/, or from the citing file's directory
    or one above it; a bare name anywhere in the tree."""
    if "/" not in ref:
        return ref in names or ref in _ELSEWHERE
    if ref.startswith("path/to/"):  # (an example of a path)
        return True
    bases = [REPO, PACKAGE, REPO / "docs", REPO / "tools", REPO / "tools" / "bench", REPO / "tests"]
    return any((base / ref).exists() for base in [*bases, *near.parents])


def test_every_file_a_comment_cites_exists() -> None:
    """Comments and docstrings cite files (`cache/ssd/store.py`, docs/design.md): a move
    that leaves a citation behind points a reader at nothing."""
    files = [p for d in ("shadefs", "tests", "tools", "examples") for p in (REPO / d).rglob("*.py")]
    names = {
        p.name
        for d in ("shadefs", "tests", "tools", "docs", "mount", "patches", "examples")
        for p in (REPO / d).rglob("*")
    } | {p.name for p in REPO.iterdir()}
    missing = sorted(
        f"{path.relative_to(REPO)}: {m.group(1)}"
        for path in files
        for m in _CITED.finditer(path.read_text())
        if not _exists(m.group(1), path, names)
    )
    assert not missing, "cited files that are not in the repository:\n  " + "\n  ".join(missing)


def _calls_of(tree: ast.AST, module: str, name: str) -> list[int]:
    """The lines where `tree` calls `module.name(...)`."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == name
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == module
    ]


def test_every_part_that_keeps_time_takes_a_clock() -> None:
    """The parts read time only through the clock they were handed (`time.monotonic` as a
    default), so that their tests move a clock instead of sleeping (docs/design.md §9)."""
    parts = ("fs", "cache", "prefetch", "readers", "source")
    calls = sorted(
        f"{path.relative_to(REPO)}:{line}"
        for part in parts
        for path in (PACKAGE / part).rglob("*.py")
        for line in _calls_of(ast.parse(path.read_text()), "time", "monotonic")
    )
    assert not calls, "time.monotonic() called where a clock should be:\n  " + "\n  ".join(calls)


def test_no_async_test_sleeps() -> None:
    """A real sleep inside an async test stops the event loop it runs on: tests move a
    FakeClock or trio's MockClock instead."""
    sleeps = sorted(
        f"{path.name}:{fn.name}:{line}"
        for path in (REPO / "tests").glob("*.py")
        for fn in ast.walk(ast.parse(path.read_text()))
        if isinstance(fn, ast.AsyncFunctionDef)
        for line in _calls_of(fn, "time", "sleep")
    )
    assert not sleeps, "time.sleep in async tests:\n  " + "\n  ".join(sleeps)


# pytest-trio's fixtures that run a test on trio's MockClock.
_CLOCK_FIXTURES = {"mock_clock", "autojump_clock"}


def _trio_waits(fn: ast.AST) -> list[int]:
    """The lines where `fn`, nested functions included, waits for trio's clock to move: a
    sleep other than `trio.sleep(0)` (a checkpoint), or a timeout that is meant to fire
    (`move_on_after`; `fail_after` only fails a test that hangs)."""
    return [
        node.lineno
        for node in ast.walk(fn)
        if _is_call(node, "trio", "move_on_after")
        or (_is_call(node, "trio", "sleep") and not _is_zero(node.args))  # type: ignore[attr-defined]
    ]


def _is_call(node: ast.AST, module: str, name: str) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == name
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == module
    )


def _is_zero(args: list[ast.expr]) -> bool:
    return bool(args) and isinstance(args[0], ast.Constant) and args[0].value == 0


def real_clock_waits(tree: ast.Module) -> list[tuple[str, int]]:
    """(test, line) where an in-process trio test waits on the real clock: an async test
    (pytest-trio) without a clock fixture, or a `trio.run` without `clock=` of a function
    defined in the test, that sleeps or times out."""
    found = []
    for fn in tree.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fn.name.startswith(
            "test_"
        ):
            continue
        if isinstance(fn, ast.AsyncFunctionDef):
            params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
            if not params & _CLOCK_FIXTURES:
                found += [(fn.name, line) for line in _trio_waits(fn)]
            continue
        nested = {
            n.name: n for n in ast.walk(fn) if isinstance(n, ast.AsyncFunctionDef) and n is not fn
        }
        for call in ast.walk(fn):
            if (
                isinstance(call, ast.Call)
                and _is_call(call, "trio", "run")
                and not any(k.arg == "clock" for k in call.keywords)
                and call.args
                and isinstance(call.args[0], ast.Name)
                and call.args[0].id in nested
            ):
                found += [(fn.name, line) for line in _trio_waits(nested[call.args[0].id])]
    return found


def test_in_process_trio_tests_wait_on_a_mock_clock() -> None:
    """A trio test that sleeps or times out runs on trio's MockClock (a clock fixture, or
    `trio.run(..., clock=...)`): virtual time passes at once and the same way on a loaded
    machine. Tests that start a real daemon wait on real time, but not in trio."""
    found = sorted(
        f"{path.name}:{test}:{line}"
        for path in (REPO / "tests").glob("test_*.py")
        for test, line in real_clock_waits(ast.parse(path.read_text()))
    )
    assert not found, "trio tests waiting on the real clock:\n  " + "\n  ".join(found)
    # The walk sees both kinds of test: it can fail.
    bad = ast.parse(
        "async def test_a():\n    await trio.sleep(0.1)\n"
        "async def test_b(autojump_clock):\n    await trio.sleep(0.1)\n"
        "def test_c():\n    async def run():\n        await trio.sleep(1)\n    trio.run(run)\n"
        "def test_d():\n    async def run():\n        await trio.sleep(1)\n"
        "    trio.run(run, clock=c)\n"
        "async def test_e():\n    await trio.sleep(0)\n"
    )
    assert real_clock_waits(bad) == [("test_a", 2), ("test_c", 7)]


def test_each_concept_has_one_home() -> None:
    """A part is a package (no top-level module named after one), a file's version is not
    the SSD format's, and the SSD tier is a subpackage of the cache."""
    parts = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    strays = sorted(
        m.name for m in PACKAGE.glob("*.py") if any(m.stem.startswith(f"{p}_") for p in parts)
    )
    assert not strays, f"top-level modules named after a part: {strays}"
    defines = {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.ClassDef) and node.name == "Signature"
    }
    assert defines == {"file_version.py"}
    assert (PACKAGE / "cache" / "ssd" / "__init__.py").exists()
    assert not list((PACKAGE / "cache").glob("ssd_*.py"))
