"""MkDocs hooks (``hooks:`` in mkdocs.yml) and a griffe extension for the API reference.

* The plots that ``make bench`` writes to ``benchmarks/plots/*.png`` are copied into the
  site under ``benchmarks/plots/``, where the pages of ``docs/benchmarks/`` show them as
  ``plots/<name>.png``. A page that shows a plot ``make bench`` no longer writes is a
  broken link, so ``mkdocs build --strict`` fails.
* A name in ``microbatching.__all__`` that the API page does not render with
  ``::: microbatching.<name>`` is a warning, so ``mkdocs build --strict`` fails.
* A line that ends with ``<!-- GitHub only -->`` is dropped from the site: pages that need
  the site (includes, the API reference) start with such a note for readers on GitHub.
* ``FenceDoctests`` (a griffe extension, ``extensions:`` of mkdocstrings in mkdocs.yml)
  fences the bare ``>>>`` examples of the docstrings as ``pycon`` code blocks; Markdown
  would otherwise read ``>>>`` as three nested quotes and ``[...]`` in an output as a link.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import griffe

ROOT = Path(__file__).resolve().parent.parent
PLOTS = ROOT / "benchmarks" / "plots"
PLOTS_URI = "benchmarks/plots"
GITHUB_ONLY = re.compile(r"^.*<!-- GitHub only -->[ \t]*\n?", flags=re.MULTILINE)
log = logging.getLogger(f"mkdocs.hooks.{__name__}")


def on_files(files: Any, *, config: Any) -> Any:
    """Adds the plots to the site's files, under ``benchmarks/plots/``."""
    from mkdocs.structure.files import File

    for png in sorted(PLOTS.glob("*.png")):
        files.append(
            File.generated(config, f"{PLOTS_URI}/{png.name}", abs_src_path=str(png))
        )
    return files


def on_page_markdown(markdown: str, *, page: Any, config: Any, files: Any) -> str:
    """Drops the notes for GitHub and checks the API page's coverage."""
    markdown = GITHUB_ONLY.sub("", markdown)
    if page.file.src_uri == "api.md":
        _check_api_coverage(markdown)
    return markdown


def _check_api_coverage(markdown: str) -> None:
    """Warns about each public name that the API page does not render."""
    import microbatching

    shown = set(
        re.findall(r"^::: microbatching\.(\w+)", markdown, flags=re.MULTILINE)
    )
    for name in sorted(set(microbatching.__all__) - shown):
        log.warning(
            f"api.md does not document microbatching.{name}: add '::: microbatching.{name}'"
        )


class FenceDoctests(griffe.Extension):
    """Wraps each run of doctest lines in a docstring in a ``pycon`` fence.

    A run starts at an unindented ``>>>`` line outside a fence and takes the lines after it
    up to a blank line: continuations and expected output.
    """

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrites ``obj``'s docstring, if it has one."""
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)


def fence_doctests(text: str) -> str:
    """``text`` with every run of doctest lines fenced as ``pycon``."""
    out: list[str] = []
    in_fence = in_run = False
    for line in text.splitlines():
        if in_run and not line.strip():
            out.append("```")
            in_run = False
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        elif not (in_fence or in_run) and line.startswith(">>>"):
            out += ["", "```pycon"] if out and out[-1].strip() else ["```pycon"]
            in_run = True
        if line.strip() or not in_run:
            out.append(line)
    if in_run:
        out.append("```")
    return "\n".join(out)
