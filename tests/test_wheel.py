"""The wheel on its own, as a user installs it.

The wheel is built from this checkout into a temporary folder (hatchling without build
isolation, about a second) and read as a zip: what it carries and what its metadata says.
Then pip installs it into a fresh virtual environment (one without pip: the development
environment's pip, run with ``--python`` for it) with its declared dependencies and nothing
else, and in that environment, away from the checkout: the README's quickstart passes as a
doctest, and then ``import microbatching`` gives the version of pyproject.toml and comes
from the environment's site-packages; and pyright (from the development environment) reads
the installed package as typed. Nothing is cached between runs, so a broken wheel cannot
hide behind an old environment; the environment is the slow part (about 20 s, mostly pip
unpacking jaxlib). To test a wheel built elsewhere, as before a release, name it in
$MICROBATCHING_WHEEL.

The README's quickstart is the first ```` ```python ```` block after the first heading
whose text contains "Quickstart" (any level, any case). It runs under the standard
library's doctest with NORMALIZE_WHITESPACE and ELLIPSIS, since pytest (and its NUMBER
flag) is not a dependency of the wheel.

Not marked x64, and skipped under JAX_ENABLE_X64=1: one run is enough.
"""

import email.parser
import json
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Sequence
from pathlib import Path

import pytest

import microbatching

pytestmark = [
    pytest.mark.wheel,
    pytest.mark.skipif(
        os.environ.get("JAX_ENABLE_X64", "").lower() in ("1", "true"),
        reason="the wheel does not depend on JAX's float width; the default run covers it",
    ),
]

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DEV_BIN = Path(sys.executable).parent

# Runs the quickstart (argv[1]) as a doctest, then says where microbatching came from, its
# version, and which development-only packages the environment can import.
QUICKSTART_RUNNER = """
import doctest, importlib.util, json, sys
text = open(sys.argv[1]).read()
test = doctest.DocTestParser().get_doctest(text, {}, "README quickstart", sys.argv[1], 0)
flags = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
runner = doctest.DocTestRunner(optionflags=flags)
runner.run(test)
result = runner.summarize(verbose=False)
import microbatching
found = [n for n in ("tests", "pytest", "optax", "flax", "equinox") if importlib.util.find_spec(n)]
print(json.dumps({"failed": result.failed, "attempted": result.attempted,
                  "file": microbatching.__file__, "version": microbatching.__version__,
                  "found": found}))
"""

WRONG_TYPE = 'microbatching.micro_vmap(jnp.sin, microbatch_size="8")'
# A user's file: the reveal_type lines must not read Unknown, and the one argument of the
# wrong type must be an error, which pyright finds only where the package is typed.
USER_FILE = f"""
import jax
import jax.numpy as jnp

import microbatching


def loss(params: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.mean((x @ params) ** 2)


grad_fn = microbatching.micro_grad(loss, batch_argnums=1, microbatch_size=8)
reveal_type(microbatching.micro_grad)
reveal_type(grad_fn)
reveal_type(microbatching.plan)
reveal_type(microbatching.AccumulationType.MEAN)
{WRONG_TYPE}
"""

# pyright reads a package without py.typed as Unknown, rather than inferring from its code.
PYRIGHT_CONFIG = {"useLibraryCodeForTypes": False, "pythonVersion": "3.11"}


def _run(
    args: Sequence[str | Path],
    *,
    cwd: Path,
    timeout: float,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> str:
    """``args``'s stdout; the test fails with the output if it exits non-zero and ``check``."""
    argv = [str(arg) for arg in args]
    result = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and result.returncode:
        pytest.fail(
            f"{' '.join(argv)} exited with {result.returncode}:\n{result.stdout}\n{result.stderr}"
        )
    return result.stdout


def readme_quickstart(readme: str) -> str:
    """The first ```python block after the first heading that contains "Quickstart"."""
    heading = re.search(r"^#+ .*quickstart", readme, flags=re.MULTILINE | re.IGNORECASE)
    assert heading is not None, "README.md has no heading with 'Quickstart' in it"
    block = re.search(r"^```python\n(.*?)^```", readme[heading.end() :], re.MULTILINE | re.DOTALL)
    assert block is not None, "README.md has no ```python block after its Quickstart heading"
    return block.group(1)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from this checkout, or the one that $MICROBATCHING_WHEEL names."""
    if given := os.environ.get("MICROBATCHING_WHEEL"):
        return Path(given).resolve(strict=True)
    out = tmp_path_factory.mktemp("dist")
    build = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", out, ROOT]
    _run(build, cwd=ROOT, timeout=1200)
    (path,) = out.glob("microbatching-*.whl")
    return path


def test_version_is_pyproject_version():
    assert microbatching.__version__ == PYPROJECT["version"]


def test_readme_quickstart_rule():
    readme = "# x\n```python\n>>> 0\n```\n## A Quickstart\ntext\n```python\n>>> 1\n1\n```\n"
    assert readme_quickstart(readme) == ">>> 1\n1\n"
    assert ">>>" in readme_quickstart((ROOT / "README.md").read_text())


def test_wheel_contents_and_metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = f"microbatching-{PYPROJECT['version']}.dist-info"
        metadata = email.parser.Parser().parsestr(archive.read(f"{info}/METADATA").decode())
    package = {name for name in names if not name.startswith(f"{info}/")}
    source_root = ROOT / "src"
    sources = {
        p.relative_to(source_root).as_posix() for p in (source_root / "microbatching").rglob("*.py")
    }
    assert package == sources | {"microbatching/py.typed"}
    assert f"{info}/licenses/LICENSE" in names
    assert metadata["Name"] == "microbatching"
    assert metadata["Version"] == PYPROJECT["version"]
    assert metadata["Requires-Python"] == PYPROJECT["requires-python"] == ">=3.11"
    assert metadata["License-Expression"] == "Apache-2.0"
    requires = metadata.get_all("Requires-Dist") or []
    runtime = sorted(r for r in requires if "extra ==" not in r)
    assert runtime == sorted(PYPROJECT["dependencies"])
    assert [re.split(r"[<>=!~ \[]", r)[0] for r in runtime] == ["jax", "numpy"]
    assert set(metadata.get_all("Provides-Extra") or []) == set(PYPROJECT["optional-dependencies"])
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert metadata.get_payload() == (ROOT / "README.md").read_text()


def test_wheel_in_fresh_environment(wheel: Path, tmp_path: Path):
    venv = tmp_path / "venv"
    # Without a pip of its own (ensurepip took a quarter of the test): the development
    # environment's pip installs into it (pip --python), resolving the dependencies for it.
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path, timeout=1200)
    python = venv / "bin" / "python"
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "JAX_ENABLE_X64"}
    }
    env |= {"PYTHONNOUSERSITE": "1", "PATH": f"{venv / 'bin'}{os.pathsep}{env['PATH']}"}
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-compile"]
    _run([*pip, "--disable-pip-version-check", wheel], cwd=tmp_path, timeout=1800, env=env)
    site_packages = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    site_packages /= "site-packages"

    quickstart = tmp_path / "quickstart.txt"
    quickstart.write_text(readme_quickstart((ROOT / "README.md").read_text()))
    runner = [python, "-c", QUICKSTART_RUNNER, quickstart]
    out = _run(runner, cwd=tmp_path, timeout=1800, env=env)
    ran = json.loads(out.splitlines()[-1])
    assert ran["failed"] == 0 and ran["attempted"] > 0, out
    assert Path(ran["file"]) == site_packages / "microbatching" / "__init__.py"
    assert ran["version"] == PYPROJECT["version"]
    assert ran["found"] == []

    _check_typed(python, site_packages, tmp_path, env)


def _check_typed(python: Path, site_packages: Path, tmp_path: Path, env: dict[str, str]) -> None:
    """pyright sees the installed package as typed: in a user's file, and every symbol."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "pyrightconfig.json").write_text(json.dumps(PYRIGHT_CONFIG))
    (user / "user.py").write_text(USER_FILE)
    pyright = [DEV_BIN / "pyright", "--outputjson", "--pythonpath", python, "user.py"]
    diagnostics = json.loads(_run(pyright, cwd=user, timeout=1200, env=env, check=False))[
        "generalDiagnostics"
    ]
    revealed = [d["message"] for d in diagnostics if d["message"].startswith("Type of")]
    assert len(revealed) == USER_FILE.count("reveal_type("), diagnostics
    assert not [message for message in revealed if "Unknown" in message], revealed
    errors = [
        (d["rule"], d["range"]["start"]["line"]) for d in diagnostics if d["severity"] == "error"
    ]
    assert errors == [("reportArgumentType", USER_FILE.splitlines().index(WRONG_TYPE))], diagnostics

    # --verifytypes finds the package with the `python` first on PATH.
    verify = [
        DEV_BIN / "pyright",
        "--outputjson",
        "--verifytypes",
        "microbatching",
        "--ignoreexternal",
    ]
    report = json.loads(_run(verify, cwd=user, timeout=1200, env=env, check=False))
    completeness = report["typeCompleteness"]
    assert Path(completeness["pyTypedPath"]) == site_packages / "microbatching" / "py.typed"
    assert completeness["completenessScore"] == 1, completeness["symbols"]
