"""Which code produced a results file: the stamp each benchmark writes, and its check.

A stamp names the command, the commit, the library's version and a SHA-256 of the sources
the figures depend on: the script, the modules of ``benchmarks/`` it imports (followed
through their own imports) and every ``.py`` file under ``src/microbatching/``. The
scripts compute it when they start and write it as the first line of their markdown (an
HTML comment, which neither GitHub nor the site shows) and into the text chunks of their
PNGs; ``tests/test_benchmarks_current.py`` computes the hash again and fails when a results
file's differs. The hash is of the files' contents, not their dates, so a checkout or a
rebase does not make a current file stale, and a change to the code does.

This module itself is not hashed: it decides how the figures are labelled, not what they are.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
LIBRARY = Path("src") / "microbatching"
# Each results file of ``make bench``, by the script that writes it.
RESULTS = {
    "MATRIX.md": "matrix.py",
    "RESULTS.md": "compare.py",
    "ACCUMULATION.md": "accumulation.py",
    "CLIPPING.md": "clipping.py",
    "COMPILE.md": "compile_time.py",
    "REMAINDER.md": "remainder.py",
    "STATISTICS.md": "gradient_statistics.py",
    "PLAN.md": "plan.py",
}
PLOTS_SCRIPT = "plots.py"  # writes benchmarks/plots/*.png
PNG_KEY = "Comment"  # the PNG text chunk that holds a plot's stamp
STAMP = re.compile(
    r"produced by `(?P<command>[^`]+)` at commit (?P<commit>[^,]+), "
    r"microbatching (?P<version>\S+); source sha256 (?P<sha256>[0-9a-f]{64})"
)


@dataclasses.dataclass(frozen=True)
class Stamp:
    """What produced a results file."""

    command: str  # as run, from the repository's root: ``python benchmarks/clipping.py``
    commit: str  # the short commit, with a note where the hashed sources differ from it
    version: str  # ``microbatching.__version__``
    sha256: str  # ``source_hash`` of the script

    def __str__(self) -> str:
        return (
            f"produced by `{self.command}` at commit {self.commit}, "
            f"microbatching {self.version}; source sha256 {self.sha256}"
        )

    def comment(self) -> str:
        """The stamp as the first line of a markdown file."""
        return f"<!-- {self} -->"

    def describe(self) -> str:
        """The stamp for a reader: the version and the commit, no hash."""
        return f"microbatching {self.version} at commit {self.commit}"

    @property
    def script(self) -> str:
        """The script's file name, from the command."""
        return Path(self.command.split()[1]).name


def _imported(path: Path, root: Path) -> set[Path]:
    """The modules of ``root/benchmarks`` that ``path`` imports, and theirs, transitively."""
    found: set[Path] = set()
    todo = [path]
    while todo:
        tree = ast.parse(todo.pop().read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                module = root / "benchmarks" / f"{name.split('.')[0]}.py"
                if module.exists() and module.name != Path(__file__).name and module not in found:
                    found.add(module)
                    todo.append(module)
    return found


def sources(script: str, root: Path = ROOT) -> list[Path]:
    """The files whose contents ``source_hash`` covers, relative to ``root``, sorted."""
    path = root / "benchmarks" / script
    files = {path, *_imported(path, root), *(root / LIBRARY).rglob("*.py")}
    return sorted(f.relative_to(root) for f in files)


def source_hash(script: str, root: Path = ROOT) -> str:
    """SHA-256 over each source's path and contents, in ``sources`` order."""
    digest = hashlib.sha256()
    for relative in sources(script, root):
        digest.update(relative.as_posix().encode() + b"\0")
        digest.update((root / relative).read_bytes() + b"\0")
    return digest.hexdigest()


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def _commit(files: Sequence[Path]) -> str:
    """The short commit of HEAD, noting whether any of ``files`` differs from it."""
    head = _git("rev-parse", "--short=12", "HEAD")
    if head is None:
        return "unknown (not a git checkout)"
    changed = _git("status", "--porcelain", "--", *(f.as_posix() for f in files))
    return f"{head} with uncommitted changes" if changed else head


def stamp(script: str, argv: Sequence[str]) -> Stamp:
    """The stamp of a run of ``script`` (its ``__file__`` or its name) with ``argv``.

    Raises:
      RuntimeError: If ``microbatching`` is imported from elsewhere than this checkout's
        ``src/``: the hash would then describe code that did not run.
    """
    import microbatching

    imported = Path(microbatching.__file__).resolve().parent
    if imported != ROOT / LIBRARY:
        raise RuntimeError(
            f"microbatching is imported from {imported}, not from {ROOT / LIBRARY}: install "
            "this checkout (`make .venv/.installed`, an editable install) to benchmark it."
        )
    script = Path(script).name
    command = " ".join(["python", f"benchmarks/{script}", *argv])
    return Stamp(command, _commit(sources(script)), microbatching.__version__, source_hash(script))


def write(path: Path, markdown: str, stamp: Stamp) -> None:
    """Writes ``markdown`` to ``path`` with ``stamp``'s comment as its first line."""
    path.write_text(f"{stamp.comment()}\n{markdown}")


def _parse(text: str) -> Stamp | None:
    found = STAMP.search(text)
    return None if found is None else Stamp(**found.groupdict())


def read(path: Path) -> Stamp | None:
    """The stamp of a markdown file (its first line) or of a PNG; None if it has none."""
    if path.suffix == ".png":
        return _parse(png_text(path).get(PNG_KEY, ""))
    return _parse(path.read_text().partition("\n")[0])


def png_text(path: Path) -> dict[str, str]:
    """The ``tEXt`` chunks of a PNG, by keyword."""
    data = path.read_bytes()
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        raise ValueError(f"{path} is not a PNG")
    chunks: dict[str, str] = {}
    at = 8
    while at + 8 <= len(data):
        length = int.from_bytes(data[at : at + 4], "big")
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            chunks[key.decode("latin-1")] = value.decode("latin-1")
        at += 12 + length  # length, type, data, CRC
    return chunks
