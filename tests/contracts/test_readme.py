"""The README's Python blocks run, and every path README.md and docs/*.md name exists.

The ```python blocks of README.md run in order in one namespace, as a reader pastes them; a block
right after the line ``<!-- readme-test: skip (why) -->`` is not run (it downloads a model, say).
A path is a markdown link's relative target (resolved from the file that holds it) or a word that
names a file or folder of this repository: one that starts with a top-level folder (``tmoe/``,
``tests/``, ...) or, with a ``/`` in it, ends in a file extension (``.py``, ``.csv``, ...), unless it
is another project's (``torch/...``). Globs (``bench/results/*.csv``) must match something;
placeholders (``<shape>``) are not checked.
"""
import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
SKIP = re.compile(r"<!--\s*readme-test:\s*skip\b.*?-->")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
TOP = ("tmoe/", "tests/", "bench/", "docs/", "examples/", "README.md", "pyproject.toml")
EXTENSIONS = (".py", ".md", ".csv", ".json", ".png", ".toml")
OTHER_PROJECTS = ("torch/", "triton/", "python/triton_kernels/", "transformers/", "peft/")
WORD = re.compile(r"(?<![\w./:-])((?:\.\./)*[\w.*<>-]+(?:/[\w.*<>-]+)*/?)")


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """(line, code, skipped) of each ```python block; skipped where the line before the fence
    (blank lines aside) is the skip comment."""
    blocks = []
    for match in FENCE.finditer(text):
        if match.group(1) != "python":
            continue
        before = text[:match.start()].rstrip().rsplit("\n", 1)[-1]
        blocks.append((text.count("\n", 0, match.start()) + 1, match.group(2), bool(SKIP.fullmatch(before.strip()))))
    return blocks


def named_paths(path: Path) -> list[tuple[str, Path]]:
    """(as written, resolved) for every repository path ``path`` names."""
    text = path.read_text()
    found = []
    prose = re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))  # links live outside code
    for target in LINK.findall(prose):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        found.append((target, (path.parent / target.split("#")[0]).resolve()))
    for word in WORD.findall(text):
        word = word.rstrip(".,;:")
        if word.startswith("../") or word.startswith(OTHER_PROJECTS):
            continue  # links are resolved above, from the file that holds them
        ours = word.startswith(TOP) or ("/" in word and word.endswith(EXTENSIONS))
        if ours and "<" not in word:
            found.append((word, ROOT / word))
    return found


def missing(path: Path) -> list[str]:
    gone = []
    for written, resolved in named_paths(path):
        exists = glob.glob(str(resolved)) if "*" in written else resolved.exists()
        if not exists:
            gone.append(written)
    return sorted(set(gone))


def test_readme_blocks_run(monkeypatch):
    """Each unskipped block runs after the ones before it; a block that raises fails the test,
    naming its line."""
    monkeypatch.chdir(ROOT)
    blocks = python_blocks(README.read_text())
    assert [b for b in blocks if not b[2]], "README.md has no python block to run"
    namespace = {"__name__": "__readme__"}
    for line, code, skipped in blocks:
        if skipped:
            continue
        try:
            exec(compile(code, f"README.md:{line}", "exec"), namespace)
        except Exception as err:
            raise AssertionError(f"README.md's python block at line {line} raised {type(err).__name__}: {err}") from err


def test_lora_doc_blocks_run_after_the_quickstart(monkeypatch):
    """docs/lora.md's blocks (training one adapter, serving several) run with the README's
    Quickstart names, as the doc says."""
    monkeypatch.chdir(ROOT)
    namespace = {"__name__": "__readme__"}
    line, code, _ = python_blocks(README.read_text())[0]
    exec(compile(code, f"README.md:{line}", "exec"), namespace)
    lora_doc = ROOT / "docs" / "lora.md"
    blocks = python_blocks(lora_doc.read_text())
    assert len(blocks) >= 2, "docs/lora.md shows training one adapter and serving several"
    for line, code, _ in blocks:
        exec(compile(code, f"docs/lora.md:{line}", "exec"), namespace)


def test_skipped_blocks_say_why():
    """A skipped block is still Python, and its comment gives a reason."""
    text = README.read_text()
    for comment in SKIP.findall(text):
        assert re.search(r"skip\s*\(\S[^)]*\)", comment), f"{comment!r}: say why the block is skipped"
    for line, code, skipped in python_blocks(text):
        if skipped:
            compile(code, f"README.md:{line}", "exec")


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_named_paths_exist(doc):
    gone = missing(doc)
    assert not gone, f"{doc.relative_to(ROOT)} names paths that do not exist: {gone}"


def test_path_check_catches_a_stale_path(tmp_path):
    """The check itself: a stale path, a stale link and an unmatched glob are reported; another
    project's path and a placeholder are not."""
    doc = tmp_path / "doc.md"
    doc.write_text("See `tmoe/no_such.py`, [x](no_such.md), `bench/results/*.nothing`, runtime/gone.py,\n"
                   "torch/export/pt2_archive/_package.py, `bench/<name>.py` and [ok](../" + tmp_path.name + "/doc.md).\n")
    assert missing(doc) == ["bench/results/*.nothing", "no_such.md", "runtime/gone.py", "tmoe/no_such.py"]


def test_skip_marker_is_read():
    text = "a\n\n<!-- readme-test: skip (network) -->\n```python\nraise SystemExit\n```\n\n```python\nx = 1\n```\n"
    assert [skipped for _, _, skipped in python_blocks(text)] == [True, False]
