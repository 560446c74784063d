"""The package's rooms import downwards only (docs/design.md): runtime < kernels < config <
modular < ops < the face, and nothing in the library imports ``tmoe.tools`` or ``tmoe.testing``
(``python -m tmoe`` is the tools' entry point).
Read from the source's import statements (module level and inside functions alike)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "tmoe"
RANK = {"runtime": 0, "kernels": 1, "config": 2, "modular": 3, "ops": 4}
BESIDE = ("tools", "testing")  # sit beside the library: they may import anything, nothing imports them


def room(module: str) -> str:
    """tmoe.kernels.align -> kernels; tmoe.fused -> face."""
    parts = module.split(".")
    if module == "tmoe.__main__":  # the command line: the tools' entry point
        return "tools"
    return parts[1] if len(parts) > 1 and (parts[1] in RANK or parts[1] in BESIDE) else "face"


def imports(path: Path) -> set[str]:
    """The tmoe modules a file imports (absolute, or relative resolved against its package)."""
    package = ".".join(("tmoe", *path.relative_to(ROOT).parent.parts))
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
    return {name for name in found if name == "tmoe" or name.startswith("tmoe.")}


def test_rooms_import_downwards():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        here = room(".".join(("tmoe", *path.relative_to(ROOT).with_suffix("").parts)))
        if here in BESIDE:
            continue
        for target in imports(path):
            there = room(target)
            if there in BESIDE or (here in RANK and (there == "face" or RANK[there] > RANK[here])):
                wrong.append(f"{path.relative_to(ROOT.parent)} ({here}) imports {target} ({there})")
    assert not wrong, "imports that point up or at the tools:\n" + "\n".join(wrong)
