"""The results of ``make bench`` describe the code as it is, and the prose quotes them.

Each results file (``benchmarks/*.md`` but the README, ``benchmarks/plots/*.png``) carries
the stamp of the run that wrote it (``benchmarks/_provenance.py``): the command, the
commit, the library's version and a SHA-256 of the sources the figures depend on. A file
whose recorded hash differs from the hash of the sources now is stale: a change to the
library or to the script since the run. The remedy is ``make bench``, which reruns every
script (20 to 80 minutes on 2 cores).

The figures that README.md and the docs quote in the results' own form, a ratio with its
quartiles (``1.00x [0.98, 1.02]``), must appear verbatim in a results file; on README.md
and the benchmarks pages, which say their figures come from the last ``make bench``, so
must every bare ratio (``0.47x``), as a ratio or a table cell. A figure that a results file
holds by chance elsewhere passes: the check finds figures that no run produced, not every
misquotation.
"""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
_spec = importlib.util.spec_from_file_location(
    "benchmarks_provenance", BENCHMARKS / "_provenance.py"
)
assert _spec is not None and _spec.loader is not None
provenance = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = provenance  # its dataclass looks its module up there
_spec.loader.exec_module(provenance)

PLOTS = sorted((BENCHMARKS / "plots").glob("*.png"))
QUARTILES = re.compile(r"\d+\.\d+x \[\d+\.\d+, \d+\.\d+\]")
RATIO = re.compile(r"(?<![\d.])(\d+\.\d+)x(?! \[)")


def _stale(path: Path, script: str) -> str | None:
    """Why ``path`` does not describe ``script``'s current sources; None if it does."""
    stamp = provenance.read(path)
    if stamp is None:
        return "it has no provenance stamp"
    if stamp.script != script:
        return f"it was written by {stamp.script}, not {script}"
    if "--quick" in stamp.command.split():
        return "it is from a --quick run"
    now = provenance.source_hash(script)
    if stamp.sha256 != now:
        return (
            f"it was produced at commit {stamp.commit} from sources whose sha256 was "
            f"{stamp.sha256[:12]}, and {script}'s sources (the script, the benchmark modules "
            f"it imports, src/microbatching/) now hash to {now[:12]}"
        )
    return None


def _rerun(script: str) -> str:
    return f"run `make bench` (or `.venv/bin/python benchmarks/{script}`, that script alone)"


@pytest.mark.parametrize(("name", "script"), list(provenance.RESULTS.items()))
def test_results_are_from_the_current_sources(name: str, script: str):
    why = _stale(BENCHMARKS / name, script)
    assert why is None, f"benchmarks/{name} is stale: {why}: {_rerun(script)}"


def test_plots_are_from_the_current_sources():
    script = provenance.PLOTS_SCRIPT
    assert PLOTS, f"benchmarks/plots/ has no PNG: {_rerun(script)}"
    stale = [f"{png.name}: {why}" for png in PLOTS if (why := _stale(png, script))]
    assert not stale, (
        "stale plots in benchmarks/plots/:\n" + "\n".join(stale) + (f"\n{_rerun(script)}")
    )


def test_every_results_file_is_known_and_make_bench_writes_it():
    written = {p.name for p in BENCHMARKS.glob("*.md")} - {"README.md"}
    assert written == set(provenance.RESULTS)
    bench = re.search(r"^bench:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert bench is not None
    run = set(re.findall(r"benchmarks/(\w+\.py)", bench[1]))
    assert run == {*provenance.RESULTS.values(), provenance.PLOTS_SCRIPT}


def _tree(root: Path) -> None:
    (root / "benchmarks").mkdir()
    (root / "src" / "microbatching" / "sub").mkdir(parents=True)
    (root / "benchmarks" / "run.py").write_text("import helper\nimport jax\n")
    (root / "benchmarks" / "helper.py").write_text("from deep import x\n")
    (root / "benchmarks" / "deep.py").write_text("x = 1\n")
    (root / "benchmarks" / "other.py").write_text("y = 2\n")
    (root / "src" / "microbatching" / "__init__.py").write_text("")
    (root / "src" / "microbatching" / "sub" / "_a.py").write_text("a = 1\n")


def test_the_hash_covers_the_script_its_imports_and_the_library(tmp_path: Path):
    _tree(tmp_path)
    assert [p.as_posix() for p in provenance.sources("run.py", tmp_path)] == [
        "benchmarks/deep.py",
        "benchmarks/helper.py",
        "benchmarks/run.py",
        "src/microbatching/__init__.py",
        "src/microbatching/sub/_a.py",
    ]
    before = provenance.source_hash("run.py", tmp_path)
    (tmp_path / "benchmarks" / "other.py").write_text("y = 3\n")  # not imported
    assert provenance.source_hash("run.py", tmp_path) == before
    for changed in ["benchmarks/deep.py", "src/microbatching/sub/_a.py", "benchmarks/run.py"]:
        (tmp_path / changed).write_text((tmp_path / changed).read_text() + "# changed\n")
        after = provenance.source_hash("run.py", tmp_path)
        assert after != before, changed
        before = after


def test_a_stamp_reads_back_from_markdown_and_png(tmp_path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stamp = provenance.Stamp("python benchmarks/run.py", "0123abcd", "9.9.9", "ab" * 32)
    markdown = tmp_path / "RUN.md"
    provenance.write(markdown, "# Run\n\n| a |\n|---|\n| 1 |\n", stamp)
    assert provenance.read(markdown) == stamp
    assert markdown.read_text().splitlines()[1] == "# Run"
    fig = plt.figure(figsize=(1, 1))
    fig.savefig(tmp_path / "run.png", metadata={provenance.PNG_KEY: str(stamp)})
    plt.close(fig)
    assert provenance.read(tmp_path / "run.png") == stamp
    assert stamp.script == "run.py"


def _results_text() -> str:
    return "\n".join((BENCHMARKS / name).read_text() for name in provenance.RESULTS)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _quotes_the_last_run(page: Path) -> bool:
    relative = page.relative_to(ROOT).as_posix()
    return relative == "README.md" or relative.startswith("docs/benchmarks")


def test_quoted_figures_come_from_a_results_file():
    results = _results_text()
    cells = set(re.findall(r"(?<![\d.])(\d+\.\d+)(?:x|\s*\|)", results))
    missing = []
    for page in _pages():
        text = page.read_text()
        for figure in QUARTILES.findall(text):
            if figure not in results:
                missing.append(f"{page.relative_to(ROOT)}: {figure}")
        if _quotes_the_last_run(page):
            for value in RATIO.findall(text):
                if value not in cells:
                    missing.append(f"{page.relative_to(ROOT)}: {value}x")
    assert not missing, (
        "figures that no results file of benchmarks/ holds (quote the current ones, or run "
        "`make bench` if the results are older than the text):\n" + "\n".join(missing)
    )
