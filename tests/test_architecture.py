"""The package's architecture: no import cycle among hf_bpd's modules (imports inside functions included), the
decoding algorithm apart from the execution machinery, module sizes, and a module map (docs/architecture.md) that
names every module."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_bpd"
# Templates written into saved checkpoints (remote code), never imported by hf_bpd itself.
TEMPLATES = PACKAGE / "hub" / "remote"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if TEMPLATES not in p.parents}


def imported(name: str, path: Path, known: set[str], missing: list | None = None) -> set[str]:
    """The hf_bpd modules `name` imports anywhere in its file (module level, functions, TYPE_CHECKING blocks);
    imports of modules that do not exist are added to `missing`."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names if a.name.split(".")[0] == "hf_bpd")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "hf_bpd":
                continue
            if target not in known and missing is not None:
                missing.append(f"{name}: from {target} import ...")
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{target}.{alias.name}"
                targets.add(sub if sub in known else target)
    resolved = set()
    for target in targets:
        while target not in known and "." in target:
            target = target.rsplit(".", 1)[0]
        if target != name:
            resolved.add(target)
    return resolved


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imported(name, path, set(found)) for name, path in found.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_sees_imports_inside_functions():
    graph = import_graph()
    # configuration validates bundled rescorer names inside a method: the edge is seen
    assert "hf_bpd.rescorers.registry" in graph["hf_bpd.configuration"]
    assert "hf_bpd.runtime.compiled" in graph["hf_bpd.runtime.cost"]  # imported inside measure_costs


def test_every_hf_bpd_import_names_an_existing_module():
    """An import inside a function runs only when the function does: a moved module must not leave one behind."""
    found, missing = modules(), []
    for name, path in found.items():
        imported(name, path, set(found), missing)
    assert missing == []


def test_no_import_cycle_among_hf_bpd_modules():
    assert cycles(import_graph()) == []


def test_the_runtime_holds_no_decoding_algorithm():
    """`hf_bpd/runtime/` (compiled steps, kernels, attention, cost tables) imports no decoding decision: at most the
    draft tree's type."""
    graph = import_graph()
    for name, targets in graph.items():
        if name.startswith("hf_bpd.runtime"):
            algorithm = {t for t in targets if t.startswith("hf_bpd.generation")} - {"hf_bpd.generation.tree"}
            assert not algorithm, (name, algorithm)


def test_module_sizes():
    sizes = {name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in modules().items()}
    assert sizes["hf_bpd.modeling"] <= 300
    assert {n: s for n, s in sizes.items() if s > 500} == {}


def test_the_architecture_page_names_every_module():
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    files = [p for p in sorted(PACKAGE.rglob("*")) if p.suffix in (".py", ".cpp") and "__pycache__" not in p.parts]
    missing = [str(p.relative_to(ROOT)) for p in files if f"`{p.relative_to(ROOT).as_posix()}`" not in page]
    assert missing == []
    # and names nothing that is not there
    named = {token.strip("`") for token in page.split() if token.startswith("`hf_bpd/")}
    stale = [n for n in named if n.rstrip("`.,;:)").endswith((".py", ".cpp")) and not (ROOT / n.rstrip("`.,;:)")).exists()]
    assert stale == []


def test_the_decoding_algorithm_reaches_the_runtime_through_one_entry():
    """`hf_bpd/generation/` imports from `hf_bpd/runtime/` only through `runtime/execution.py`, and names no runner
    class, graph kind or CPU: which graphs exist and what a machine has stay behind that entry."""
    graph = import_graph()
    for name, targets in graph.items():
        if name.startswith("hf_bpd.generation"):
            reached = {t for t in targets if t.startswith("hf_bpd.runtime")} - {"hf_bpd.runtime",
                                                                                "hf_bpd.runtime.execution"}
            assert not reached, (name, reached)
    machine_words = ("avx", "amx", "epyc", "xeon", "register", "artifact", "ArtifactRunner", "CompiledRunner",
                     "BatchedRunner")
    for path in sorted((PACKAGE / "generation").glob("*.py")):
        text = path.read_text(encoding="utf-8").lower()
        assert [w for w in machine_words if w.lower() in text] == [], path.name


def test_the_decoding_loops_never_branch_on_a_drafters_type():
    """The loops ask every drafter the same questions (`generation.drafting.Drafter`): no `isinstance` on a drafter
    class in the single-sequence and batch loops."""
    drafters = {"Drafter", "BlockDrafter", "FeatureChainDrafter", "NoDrafter"}
    for loop in ("decoding.py", "batch.py"):
        tree = ast.parse((PACKAGE / "generation" / loop).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                assert not {getattr(c, "id", None) for c in classes} & drafters, (loop, ast.unparse(node))
