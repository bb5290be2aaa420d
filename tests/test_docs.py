"""The site's own code: the copy button of ``>>>`` blocks, and the notes for GitHub readers.

``docs/javascripts/doctest-copy.js`` gives material's copy button the code of a block of
``>>>`` examples. Its ``runnableCode`` runs under node on every such block of README.md and
the docs (and a few made-up edge cases), against an independent reference: the sources
that the standard library's doctest parser finds, with a blank line after each example
that spans several lines (the script's rule for a Python prompt).
"""

import doctest
import importlib.util
import itertools
import json
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").rglob("*.md"))
SCRIPT = ROOT / "docs" / "javascripts" / "doctest-copy.js"
FENCE = re.compile(r"^(?P<indent>[ \t]*)```[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)
# Syntax that only the site renders: an include of the include-markdown plugin, a
# mkdocstrings directive.
SITE_ONLY = re.compile(r"\{%|^::: ", re.MULTILINE)
EDGE_CASES = [
    # A compound statement, then an output that starts with "...", which is not code.
    '>>> def f(x):\n...     return x\n>>> print("a\\n...")\na\n...\n>>> f(1)\n1\n',
    # A bare "..." continuation, a traceback, a blank line between examples.
    ">>> xs = [\n...\n... ]\n>>> 1 +\nTraceback (most recent call last):\n  ...\n"
    "SyntaxError: invalid syntax\n\n>>> xs\n[]\n",
    "no prompts here\n",
]


def code_blocks() -> list[str]:
    """The text of every fenced code block of README.md and the docs, dedented."""
    blocks = []
    for page in [ROOT / "README.md", *PAGES]:
        for fence in FENCE.finditer(page.read_text()):
            blocks.append(textwrap.dedent(fence["body"]))
    return blocks


def doctest_code(text: str) -> str | None:
    """The examples' sources as doctest parses them, or None where there are none."""
    examples = doctest.DocTestParser().get_examples(text)
    if not examples:
        return None
    code = examples[0].source
    for previous, example in itertools.pairwise(examples):
        code += ("\n" if previous.source.count("\n") > 1 else "") + example.source
    return code


def test_copy_button_copies_the_code_of_every_doctest_block():
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (pyright installs its own when it needs one)")
    blocks = code_blocks() + EDGE_CASES
    assert sum(">>>" in block for block in blocks) > 50
    program = (
        f"const {{ runnableCode }} = require({json.dumps(str(SCRIPT))});"
        "const blocks = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
        "process.stdout.write(JSON.stringify(blocks.map(runnableCode)));"
    )
    done = subprocess.run(
        [node, "-e", program],
        input=json.dumps(blocks),
        capture_output=True,
        text=True,
        timeout=1200,
        check=True,
    )
    copied = json.loads(done.stdout)
    for block, code in zip(blocks, copied, strict=True):
        assert code == doctest_code(block), block


def test_pages_with_site_only_syntax_start_with_a_note_for_github():
    """Such a page's first paragraph after its title is a one-line note for readers on
    GitHub, which the site's hook drops."""
    hooks_spec = importlib.util.spec_from_file_location("hooks", ROOT / "docs" / "hooks.py")
    assert hooks_spec is not None and hooks_spec.loader is not None
    hooks = importlib.util.module_from_spec(hooks_spec)
    hooks_spec.loader.exec_module(hooks)
    noted = []
    for page in PAGES:
        text = page.read_text()
        if SITE_ONLY.search(text):
            noted.append(page.relative_to(ROOT / "docs").as_posix())
            note = text.split("\n\n")[1]
            assert note.startswith("> ") and "make serve" in note, page
            assert note.endswith("<!-- GitHub only -->"), page
            assert note not in hooks.GITHUB_ONLY.sub("", text), page
    assert {"api.md", "benchmarks/matrix.md", "how-to/multi-device.md"} <= set(noted)
