"""The house's arrows, read from the source: applications -> library -> engine contract -> engine, never back.

The import graph of ``fsdp_cudagraph``, ``megatron_fsdp`` and ``benchmarks`` is built with ``ast`` (nothing is
imported or run), so a new arrow that breaks the layout in docs/design.md fails here, naming the file, the
line and the rule. Every ``import`` statement counts, deferred ones inside functions included (they run too);
imports under ``if TYPE_CHECKING:`` are annotations, not arrows, and are skipped.

Rules:
1. no circles (strongly connected components of more than one module, or a module importing itself);
2. no library module (``fsdp_cudagraph`` outside ``apps/``) imports an application;
3. one door to the engines: no library module outside ``fsdp_cudagraph/engines/`` imports an engine
   (any ``megatron_fsdp`` module, ``torch.distributed.fsdp``, ``megatron``); the applications (``apps/``,
   ``checker/``) build models with engines and may;
4. ``megatron_fsdp`` never imports ``fsdp_cudagraph``;
5. a graph kind (``fsdp_cudagraph/graphs/*``) imports of the library only the capture core (``capture/``),
   the door (``engines.contract``, ``engines.registry``), ``config``, ``hooks``, ``offload/`` and other kinds;
6. no "no engine" branch in a graph kind: every model has an adapter (``engines/plain.py`` for an unwrapped
   one), so ``engine is None`` / ``self.engine is not None`` never appears in ``graphs/``;
7. one FSDP2 builder: nothing outside ``fsdp_cudagraph/engines/`` imports torch's ``fully_shard`` (library,
   applications, benchmarks and tests go through ``engines.fsdp2.fsdp2_shard`` / ``shard_fsdp2``, which always
   pass a mesh on the model's device);
8. no private import across engine folders: a module outside ``engines/<engine>/`` imports no ``_name`` of it.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Optional, Set, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("fsdp_cudagraph", "megatron_fsdp", "benchmarks")
#: Engines outside this repository: an import of one is kept as an arrow to its top name (rule 3).
EXTERNAL_ENGINES = ("torch.distributed.fsdp", "megatron")
#: What a graph kind may import of the library (rule 5), by module prefix.
GRAPH_KIND_IMPORTS = ("fsdp_cudagraph.capture", "fsdp_cudagraph.engines.contract", "fsdp_cudagraph.engines.registry",
                      "fsdp_cudagraph.config", "fsdp_cudagraph.hooks", "fsdp_cudagraph.offload", "fsdp_cudagraph.graphs")

#: module -> [(imported module, line)]
Graph = Dict[str, List[Tuple[str, int]]]


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_lines(tree: ast.AST) -> Set[int]:
    lines: Set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                for child in node.body:
                    for sub in ast.walk(child):
                        if hasattr(sub, "lineno"):
                            lines.add(sub.lineno)
    return lines


def read_sources() -> Dict[str, Tuple[str, bool]]:
    """module name -> (source text, is a package ``__init__``) of every file of PACKAGES."""
    return {_module_name(p): (p.read_text(), p.name == "__init__.py") for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def build_graph(sources: Optional[Dict[str, Tuple[str, bool]]] = None) -> Graph:
    """The import graph of ``sources`` (default: the repository's files, :func:`read_sources`)."""
    files = read_sources() if sources is None else sources
    modules = set(files)
    # Benchmarks run as scripts and import each other by bare name (``import _flops``), across their subfolders
    # (diagnose/, tools/) too: benchmarks/_common.py puts every folder on sys.path.
    bare = {name.rpartition(".")[2]: name for name in modules if name.startswith("benchmarks.")}

    def resolve(name: str) -> str:
        if name in bare:
            return bare[name]
        while name and name not in modules:  # torch.nn -> not ours; fsdp_cudagraph.hooks.x -> fsdp_cudagraph.hooks
            name = name.rpartition(".")[0]
        return name

    graph: Graph = {}
    for name, (text, is_pkg) in files.items():
        tree = ast.parse(text, filename=name)
        skip = _type_checking_lines(tree)
        here = name if is_pkg else name.rpartition(".")[0]
        edges: List[Tuple[str, int]] = []
        for node in ast.walk(tree):
            if node.lineno in skip if hasattr(node, "lineno") else False:
                continue
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                # ``from pkg import mod`` is an arrow to pkg.mod when that is a module, else to pkg.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                r = resolve(t)
                if not r and any(t == e or t.startswith(e + ".") for e in EXTERNAL_ENGINES):
                    r = next(e for e in EXTERNAL_ENGINES if t == e or t.startswith(e + "."))
                if r and r != name:
                    edges.append((r, node.lineno))
        graph[name] = edges
    return graph


def circles(graph: Graph) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w, _ in graph.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def is_app(module: str) -> bool:
    return module.startswith("fsdp_cudagraph.apps")


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def is_library(module: str) -> bool:
    """``fsdp_cudagraph`` minus its applications (``apps/``, the alignment checker ``checker/``)."""
    return (_under(module, "fsdp_cudagraph") and not _under(module, "fsdp_cudagraph.apps")
            and not _under(module, "fsdp_cudagraph.checker"))


def is_engine(module: str) -> bool:
    return _under(module, "megatron_fsdp") or any(_under(module, e) for e in EXTERNAL_ENGINES)


def violations(graph: Graph) -> List[str]:
    """Every arrow that breaks rules 2-5, as 'module:line -> module: rule'."""
    out = []
    for src, edges in sorted(graph.items()):
        for dst, line in edges:
            where = f"{src}:{line} -> {dst}"
            if src.startswith("fsdp_cudagraph") and not is_app(src) and is_app(dst):
                out.append(f"{where}: a library module imports an application (move the shared piece into the library)")
            if is_library(src) and not _under(src, "fsdp_cudagraph.engines") and is_engine(dst):
                out.append(f"{where}: the library imports an engine outside engines/ (ask the engine's adapter through "
                           "engines.contract; engines/ is the one door)")
            if src.startswith("megatron_fsdp") and dst.startswith("fsdp_cudagraph"):
                out.append(f"{where}: the engine imports the graph layer (the arrow must point the other way)")
            if (_under(src, "fsdp_cudagraph.graphs") and _under(dst, "fsdp_cudagraph")
                    and not any(_under(dst, ok) for ok in GRAPH_KIND_IMPORTS)):
                out.append(f"{where}: a graph kind imports past the capture core and the door (allowed: "
                           f"{', '.join(GRAPH_KIND_IMPORTS)})")
    return out


@pytest.fixture(scope="module")
def graph() -> Graph:
    return build_graph()


def test_the_graph_sees_the_house(graph):
    # Guard the reader itself: it finds the rooms and the arrows it must judge.
    assert {"fsdp_cudagraph.graphs.partial", "fsdp_cudagraph.engines.megatron_fsdp.adapter", "megatron_fsdp._unit",
            "fsdp_cudagraph.apps.train", "benchmarks.bench_full_iteration", "benchmarks._flops"} <= set(graph)
    assert ("fsdp_cudagraph.engines.registry", 0) not in graph["fsdp_cudagraph.graphs.partial"]
    assert "fsdp_cudagraph.engines.registry" in {d for d, _ in graph["fsdp_cudagraph.graphs.partial"]}
    assert "torch.distributed.fsdp" in {d for d, _ in graph["fsdp_cudagraph.engines.fsdp2.adapter"]}  # external
    assert "benchmarks._flops" in {d for d, _ in graph["benchmarks.bench_full_iteration"]}  # a deferred bare import
    assert "megatron_fsdp._unit" in {d for d, _ in graph["megatron_fsdp._fully_shard"]}


def test_no_circles(graph):
    assert circles(graph) == []


def test_arrows_point_one_way(graph):
    assert violations(graph) == []


def test_the_rules_catch_a_forbidden_arrow(graph):
    # Each rule fails on one added arrow: the checks above could fail.
    bad = {k: list(v) for k, v in graph.items()}
    bad["fsdp_cudagraph.graphs.inference"].append(("fsdp_cudagraph.apps.model", 1))
    bad["fsdp_cudagraph.graphs.partial"].append(("megatron_fsdp._unit", 2))
    bad["megatron_fsdp._unit"].append(("fsdp_cudagraph.hooks", 3))
    found = violations(bad)
    assert any("graphs.inference:1 -> fsdp_cudagraph.apps.model: a library module imports an application" in v
               for v in found), found
    assert any("graphs.partial:2 -> megatron_fsdp._unit: the library imports an engine outside engines/" in v
               for v in found), found
    assert any("megatron_fsdp._unit:3 -> fsdp_cudagraph.hooks: the engine imports the graph layer" in v
               for v in found), found
    bad["fsdp_cudagraph.capture.streams"].append(("fsdp_cudagraph.graphs.partial", 4))
    assert any("fsdp_cudagraph.capture.streams" in c and "fsdp_cudagraph.graphs.partial" in c for c in circles(bad))


def _planted(**fakes: str) -> Graph:
    """The repository's import graph with in-memory modules added (nothing is written into the package)."""
    sources = read_sources()
    sources.update({name: (text, False) for name, text in fakes.items()})
    return build_graph(sources)


def test_the_door_rules_catch_planted_imports():
    # Rules 3 and 5 read from source: each fails on a planted file, and the real files stay clean.
    found = violations(_planted(**{
        "fsdp_cudagraph.offload.planted": "from megatron_fsdp import is_capturing\n",
        "fsdp_cudagraph.capture.planted": "import megatron_fsdp.graph_contract\n"
                                          "from torch.distributed.fsdp import FSDPModule\n",
        "fsdp_cudagraph.graphs.planted": "from fsdp_cudagraph.engines import adapter_for\n"
                                         "from fsdp_cudagraph.engines.megatron_fsdp.adapter import MegatronFSDPEngine\n"
                                         "from fsdp_cudagraph.checker import records\n"
                                         "from fsdp_cudagraph.engines.registry import adapter_for\n",
        "fsdp_cudagraph.checker.planted": "from megatron_fsdp import fully_shard\n",
    }))
    door = "the library imports an engine outside engines/"
    kind = "a graph kind imports past the capture core and the door"
    assert f"fsdp_cudagraph.offload.planted:1 -> megatron_fsdp: {door}" in "\n".join(found), found
    assert any(v.startswith("fsdp_cudagraph.capture.planted:1 -> megatron_fsdp.graph_contract: " + door) for v in found)
    assert any(v.startswith("fsdp_cudagraph.capture.planted:2 -> torch.distributed.fsdp: " + door) for v in found)
    assert any(v.startswith("fsdp_cudagraph.graphs.planted:1 -> fsdp_cudagraph.engines: " + kind) for v in found)
    assert any(v.startswith("fsdp_cudagraph.graphs.planted:2 -> fsdp_cudagraph.engines.megatron_fsdp.adapter: " + kind)
               for v in found)
    assert any(v.startswith("fsdp_cudagraph.graphs.planted:3 -> fsdp_cudagraph.checker.records: " + kind) for v in found)
    assert not any(v.startswith("fsdp_cudagraph.graphs.planted:4") for v in found)  # the registry is the door
    assert not any(v.startswith("fsdp_cudagraph.checker.planted") for v in found)  # an application may
    assert violations(build_graph()) == []


def test_engine_adapters_are_the_one_door(graph):
    # engines/megatron_fsdp/ is the library's only importer of megatron_fsdp; the contract names no engine.
    importers = {src for src, edges in graph.items() for d, _ in edges if is_library(src) and is_engine(d)}
    assert "fsdp_cudagraph.engines.megatron_fsdp.adapter" in importers
    assert "fsdp_cudagraph.engines.fsdp2.adapter" in importers and "fsdp_cudagraph.engines.fsdp2.build" in importers
    ours = {src for src in importers if any(_under(d, "megatron_fsdp") for d, _ in graph[src])}
    assert ours == {"fsdp_cudagraph.engines.megatron_fsdp.adapter", "fsdp_cudagraph.engines.megatron_fsdp.build"}
    assert not importers & {"fsdp_cudagraph.engines", "fsdp_cudagraph.engines.contract", "fsdp_cudagraph.engines.plain",
                            "fsdp_cudagraph.engines.registry", "fsdp_cudagraph.engines.hookplan",
                            "fsdp_cudagraph.engines.build"}


# ---------------------------------------------------------------------------------------------- rules 6-8
#: Where rule 7 looks for FSDP2 builds: everything that runs, tests included.
BUILD_SCAN = ("fsdp_cudagraph", "megatron_fsdp", "benchmarks", "tests", "examples", "scripts")
ENGINE_FOLDERS = ("megatron_fsdp", "fsdp2", "nvidia")
#: Modules that call torch's fully_shard on purpose: the CPU-mesh test's control (torch's own call, no mesh).
FSDP2_BUILD_ALLOWED = ("tests.adapters.test_fsdp2_cpu_mesh",)


def _sources(packages) -> Dict[str, str]:
    """module name -> source text of every ``*.py`` under ``packages`` (those that exist)."""
    return {_module_name(p): p.read_text() for pkg in packages if (ROOT / pkg).is_dir() for p in (ROOT / pkg).rglob("*.py")}


def _engine_ref(node: ast.AST) -> bool:
    """``engine`` or ``<anything>.engine``: the adapter a graph kind holds."""
    return (isinstance(node, ast.Name) and node.id == "engine") or (isinstance(node, ast.Attribute) and node.attr == "engine")


def none_branches(sources: Dict[str, str]) -> List[str]:
    """Rule 6: every ``engine is None`` / ``engine is not None`` in a graph kind, as 'module:line: rule'."""
    out = []
    for name, text in sorted(sources.items()):
        if not _under(name, "fsdp_cudagraph.graphs"):
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
                sides = [node.left, *node.comparators]
                if any(_engine_ref(x) for x in sides) and any(isinstance(x, ast.Constant) and x.value is None for x in sides):
                    out.append(f"{name}:{node.lineno}: a 'no engine' branch in a graph kind (every model has an adapter, "
                               "engines/plain.py for an unwrapped one: ask it, or test for a role with isinstance)")
    return out


def fsdp2_builds(sources: Dict[str, str]) -> List[str]:
    """Rule 7: every import of torch's ``fully_shard`` outside ``fsdp_cudagraph/engines/``."""
    out = []
    for name, text in sorted(sources.items()):
        if _under(name, "fsdp_cudagraph.engines") or name in FSDP2_BUILD_ALLOWED:
            continue
        for node in ast.walk(ast.parse(text)):
            imported = isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed.fsdp") \
                and any(a.name == "fully_shard" for a in node.names)
            called = isinstance(node, ast.Attribute) and node.attr == "fully_shard" \
                and ast.unparse(node.value).endswith("distributed.fsdp")
            if imported or called:
                out.append(f"{name}:{node.lineno}: an FSDP2 build outside engines/ (use fsdp_cudagraph.engines.fsdp2's "
                           "fsdp2_shard or shard_fsdp2: they pass a mesh on the model's device)")
    return out


def private_engine_imports(sources: Dict[str, str]) -> List[str]:
    """Rule 8: every import of a ``_private`` name or module of an engine folder from outside that folder."""
    out = []
    for name, text in sorted(sources.items()):
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.ImportFrom) or not node.module or node.level:
                continue
            parts = node.module.split(".")
            if parts[:2] != ["fsdp_cudagraph", "engines"] or len(parts) < 3 or parts[2] not in ENGINE_FOLDERS:
                continue
            folder = ".".join(parts[:3])
            if _under(name, folder):
                continue
            private = [a.name for a in node.names if a.name.startswith("_")] + [p for p in parts[3:] if p.startswith("_")]
            if private:
                out.append(f"{name}:{node.lineno}: imports {private} of {folder}, private to that engine folder (make it "
                           "public there, or move the shared piece into engines/)")
    return out


def test_no_none_engine_branch_in_graph_kinds():
    assert none_branches(_sources(("fsdp_cudagraph",))) == []


def test_no_fsdp2_build_outside_engines():
    assert fsdp2_builds(_sources(BUILD_SCAN)) == []


def test_no_private_import_across_engine_folders():
    assert private_engine_imports(_sources(("fsdp_cudagraph", "benchmarks"))) == []


def test_rules_6_to_8_catch_planted_violations():
    # Each rule fails on one planted file (in memory), so the three checks above could fail.
    planted = {
        "fsdp_cudagraph.graphs.planted": "def f(self):\n    if self.engine is not None:\n        pass\n"
                                         "    return engine if engine is None else 1\n",
        "benchmarks.planted": "def build(m):\n    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard\n"
                              "    fully_shard(m)\n",
        "tests.planted": "import torch.distributed.fsdp\n\ntorch.distributed.fsdp.fully_shard(None)\n",
        "fsdp_cudagraph.engines.nvidia.planted": "from fsdp_cudagraph.engines.fsdp2.storage import _aligned\n",
        "fsdp_cudagraph.engines.fsdp2.planted": "from fsdp_cudagraph.engines.fsdp2.storage import _aligned\n",
    }
    branches = none_branches(planted)
    assert [v.split(":")[:2] for v in branches] == [["fsdp_cudagraph.graphs.planted", "2"],
                                                    ["fsdp_cudagraph.graphs.planted", "4"]], branches
    builds = fsdp2_builds(planted)
    assert [v.split(":")[:2] for v in builds] == [["benchmarks.planted", "2"], ["tests.planted", "3"]], builds
    private = private_engine_imports(planted)
    assert len(private) == 1 and private[0].startswith("fsdp_cudagraph.engines.nvidia.planted:1: imports ['_aligned'] "
                                                       "of fsdp_cudagraph.engines.fsdp2"), private
