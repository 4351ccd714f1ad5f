"""ringseq's modules import one another without circles (a module that imports another, even
inside a function, must not be imported back by it or by anything it imports): the config is a
leaf that ``init`` consumes, the timing ledger a leaf that lockstep and the ring record into."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"ringseq": ROOT / "ringseq", "ringseq.patches": ROOT / "patches", "ringseq.launch": ROOT / "launch"}


def _modules() -> dict:
    mods = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path: Path, mods: dict) -> set:
    found = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_package else name.split(".")[:-1]
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        # a package's own children are what it gathers, not what it depends on
        found |= {t for t in targets if t in mods and t != name and not t.startswith(name + ".")}
    return found


def test_no_import_circles():
    mods = _modules()
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    circles = []

    def visit(node, stack, done):
        for dep in sorted(graph[node]):
            if dep in stack:
                circles.append(stack[stack.index(dep):] + [dep])
            elif dep not in done:
                done.add(dep)
                visit(dep, stack + [dep], done)

    for name in sorted(graph):
        visit(name, [name], {name})
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles[:10])


def test_the_leaves_import_no_other_ringseq_module():
    mods = _modules()
    for leaf, allowed in (("ringseq.config", {"ringseq.errors", "ringseq.lengths"}), ("ringseq.ledger", set()),
                          ("ringseq.lengths", {"ringseq.errors"}), ("ringseq.tolerance", set())):
        got = {m for m in _imports(leaf, mods[leaf], mods) if m != "ringseq"}
        assert got <= allowed, (leaf, got)
