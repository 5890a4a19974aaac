"""Every module, script and test parses on the oldest Python the package claims (pyproject's requires-python).

``ast.parse(feature_version=...)`` catches most newer syntax on any interpreter, but not all of it (PEP 701
f-strings, e.g. nested same quotes, are only refused by a real 3.11 parser), so the files are also compiled
by the 3.11 compat environment's own interpreter when it exists.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TREES = ("megatron_mesh_cp", "scripts", "tests")
PY311 = ROOT / ".venv311" / "bin" / "python"


def _sources():
    return sorted(p for t in TREES for p in (ROOT / t).rglob("*.py") if "__pycache__" not in p.parts)


def _claimed_minimum():
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'^requires-python\s*=\s*">=\s*(\d+)\.(\d+)"', text, re.M)
    assert m, "pyproject.toml: requires-python must read \">=3.X\""
    return int(m.group(1)), int(m.group(2))


def test_claimed_python_is_the_one_ci_compiles_with():
    assert _claimed_minimum() == (3, 11), "requires-python and the compat environment (Python 3.11) must agree"


def _ast_errors(paths, version):
    bad = []
    for p in paths:
        try:
            ast.parse(p.read_text(), filename=str(p), feature_version=version)
        except SyntaxError as e:
            bad.append(f"{p.name}:{e.lineno}: {e.msg}")
    return bad


def test_every_file_parses_with_the_claimed_feature_version():
    version = _claimed_minimum()
    bad = _ast_errors(_sources(), version)
    assert not bad, f"not valid Python {version[0]}.{version[1]}:\n" + "\n".join(bad)


@pytest.mark.skipif(sys.version_info < (3, 12), reason="the 3.12 syntax must parse on the running Python")
def test_the_feature_version_check_catches_312_syntax(tmp_path):
    p = tmp_path / "pep695.py"
    p.write_text("type Pair = tuple[int, int]\n")
    assert _ast_errors([p], (3, 11)) and not _ast_errors([p], (3, 12))


_COMPILE = """
import sys
bad = []
for path in sys.argv[1:]:
    try:
        with open(path, encoding="utf-8") as f:
            compile(f.read(), path, "exec", dont_inherit=True)
    except SyntaxError as e:
        bad.append(f"{path}:{e.lineno}: {e.msg}")
print("\\n".join(bad))
sys.exit(1 if bad else 0)
"""


def _compile_with(python, paths):
    return subprocess.run([str(python), "-c", _COMPILE, *map(str, paths)], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(not PY311.exists(), reason="no .venv311 (the 3.11 compat environment)")
def test_every_file_compiles_on_python_311():
    r = _compile_with(PY311, _sources())
    assert r.returncode == 0, "SyntaxError on Python 3.11:\n" + r.stdout + r.stderr


@pytest.mark.skipif(not PY311.exists(), reason="no .venv311 (the 3.11 compat environment)")
def test_the_311_check_catches_a_nested_same_quote_fstring(tmp_path):
    """The check above can fail: a PEP 701 f-string that Python >= 3.12 accepts is refused by 3.11."""
    p = tmp_path / "pep701.py"
    p.write_text('x = 1\ny = f"{"a" if x else "b"}"\n')
    if sys.version_info >= (3, 12):
        compile(p.read_text(), str(p), "exec")  # valid here, so only the real 3.11 parser can catch it
    r = _compile_with(PY311, [p])
    assert r.returncode == 1 and "pep701.py:2" in r.stdout
