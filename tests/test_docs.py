"""The docs are the repository's own and say where things are: links, cited paths and the module map resolve.

* every relative link (and image) in README.md and docs/*.md points at an existing file, and an anchor
  at a heading of that file (GitHub's heading slugs);
* every repository path cited in the Markdown files and in the package's, scripts' and tests' sources
  (``docs/...``, ``scripts/...``, ``configs/...``, ``megatron_mesh_cp/...``, ``tests/...``) exists, and a
  bare upper-case ``NAME.md`` is a file of docs/ or of the top level;
* README's module map ("How it is built") names only existing modules, folders and scripts, and names every
  module of the package and every script.

Text only: nothing here imports torch or the package.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "megatron_mesh_cp"
README = ROOT / "README.md"
MARKDOWN = [README, *sorted((ROOT / "docs").glob("*.md"))]
SOURCE_TREES = ("megatron_mesh_cp", "scripts", "tests")
SOURCE_SUFFIXES = {".py", ".sh", ".sbatch", ".yaml"}
#: Placeholders the sources and docs use for a file of the user's (``--config configs/NAME.yaml``).
PLACEHOLDERS = {"NAME", "X", "FILE", "BASE"}


def _walk(top: Path):
    return sorted(p for p in top.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")


def _sources():
    """The sources whose cited paths are checked (this file's deliberately broken examples left out)."""
    this = Path(__file__).resolve()
    return [p for t in SOURCE_TREES for p in _walk(ROOT / t) if p.suffix in SOURCE_SUFFIXES and p != this]


def _rel(p: Path) -> str:
    try:
        return str(p.relative_to(ROOT))
    except ValueError:  # the checks' own examples, written under tmp_path
        return p.name


# --- Markdown: links and anchors -------------------------------------------------------------------------

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text without fenced code blocks and code spans (links and headings are not parsed in them)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: rendered text, lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    keep = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LMN")
    return keep.replace(" ", "-")


def anchors(path: Path) -> set:
    seen, out = {}, set()
    for m in _HEADING.finditer(_FENCE.sub("", path.read_text())):
        base = slug(m.group(2))
        k = seen.get(base, 0)
        seen[base] = k + 1
        out.add(base if k == 0 else f"{base}-{k}")
    return out


def links(text: str):
    prose = _prose(text)
    return [m.group(1) for m in _LINK.finditer(prose)] + [m.group(1) for m in _REF_DEF.finditer(prose)]


def broken_links(path: Path):
    bad = []
    for target in links(path.read_text()):
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{_rel(path)}: link to {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{_rel(path)}: link to {target}: no heading with that anchor in {_rel(dest)}")
    return bad


def test_markdown_links_resolve():
    bad = [b for p in MARKDOWN for b in broken_links(p)]
    assert not bad, "\n".join(bad)


def test_the_link_check_can_fail(tmp_path):
    (tmp_path / "a.md").write_text("# A title, with `code`\n\n## Same\n\n## Same\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md) [ok](a.md#a-title-with-code) [ok](a.md#same-1) [ok](#top) [web](https://x.org/y)\n"
                    "[gone](missing.md) [gone](a.md#nope) ![gone](img.png)\n```\n[ignored](in-a-fence.md)\n```\n"
                    "`[ignored](in-a-span.md)`\n\n# Top\n")
    bad = broken_links(page)
    assert len(bad) == 3 and all(s in "".join(bad) for s in ("missing.md", "a.md#nope", "img.png")), bad


# --- paths cited in Markdown and in the sources ----------------------------------------------------------

_PATH = re.compile(r"(?<![\w./$-])((?:docs|scripts|tests|configs|megatron_mesh_cp|patches|requirements)/"
                   r"(?:[\w.*<>/-]|\{[\w.,-]*\})*)")
_BARE_MD = re.compile(r"(?<![\w./$-])([A-Z][A-Z0-9_]*\.md)\b")


def _expand(path: str):
    """Brace alternatives expanded (``llama31_{8b,70b}_*.yaml``), placeholders made globs."""
    m = re.search(r"\{([^}]*)\}", path)
    if m:
        return [q for alt in m.group(1).split(",") for q in _expand(path[:m.start()] + alt + path[m.end():])]
    path = re.sub(r"<[^>]*>", "*", path)
    path = "/".join(re.sub(r"^(%s)(?=\.|$)" % "|".join(PLACEHOLDERS), "*", part) for part in path.split("/"))
    return [path]


def _exists(path: str) -> bool:
    return all(any(ROOT.glob(p)) if "*" in p else (ROOT / p).exists() for p in _expand(path))


def cited_paths(text: str):
    """(line, path) of every repository path the text cites: a file name with a suffix, or a folder ending in /."""
    out = []
    for m in _PATH.finditer(text):
        path = m.group(1).rstrip(".")
        if re.search(r"\.\w+$", path) or path.endswith("/"):
            out.append((text.count("\n", 0, m.start()) + 1, path))
    for m in _BARE_MD.finditer(text):
        if m.group(1)[:-3] not in PLACEHOLDERS:
            out.append((text.count("\n", 0, m.start()) + 1, m.group(1)))
    return out


def _without_map_entries(text: str) -> str:
    """README with the module map's first column blanked: its entries are package-relative (checked below)."""
    m = re.search(r"^## How it is built\n(.*?)(?=^## )", text, re.M | re.S)
    if not m:
        return text
    rows = [re.sub(r"^(\s*\|)[^|]*", r"\1", line) if line.lstrip().startswith("|") else line
            for line in m.group(1).split("\n")]
    return text[:m.start(1)] + "\n".join(rows) + text[m.end(1):]


def missing_paths(path: Path):
    bad = []
    text = path.read_text(encoding="utf-8")
    for line, cited in cited_paths(_without_map_entries(text) if path == README else text):
        if "/" in cited:
            ok = _exists(cited)
        else:  # a bare NAME.md: docs/ or the top level
            ok = (ROOT / "docs" / cited).exists() or (ROOT / cited).exists()
        if not ok:
            bad.append(f"{_rel(path)}:{line}: cites {cited}, which is not in the repository")
    return bad


def test_cited_paths_exist():
    bad = [b for p in MARKDOWN + _sources() for b in missing_paths(p)]
    assert not bad, "\n".join(bad)


def test_the_path_check_can_fail(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text('"""See docs/DESIGN.md, README.md and configs/NAME.yaml; docs/gone.md; DESIGN.md 3."""\n'
                   "# configs/clusters/ (not at the top) and megatron_mesh_cp/configs/clusters/; GONE.md\n"
                   "x = 'configs/llama31_{8b,70b}_cpt_s1_128k.yaml', 'configs/llama31_{8b,9b}_cpt_s1_128k.yaml'\n"
                   "y = '$root/scripts/nothing.sh', '--docs/--doc-lengths', 'docs/seq', 'scripts/slurm/<job>.sbatch'\n")
    bad = missing_paths(src)
    text = "\n".join(bad)
    assert len(bad) == 4, text
    for gone in ("docs/gone.md", "configs/clusters/", "GONE.md", "llama31_{8b,9b}"):
        assert gone in text, (gone, text)


# --- README's module map ---------------------------------------------------------------------------------


def module_map(text: str):
    """Every path the "How it is built" tables name in their first column: (path relative to the root, raw)."""
    m = re.search(r"^## How it is built\n(.*?)(?=^## )", text, re.M | re.S)
    assert m, 'README.md has no "## How it is built" section'
    out = []
    for line in m.group(1).splitlines():
        cells = line.split("|")
        if len(cells) < 3 or not line.lstrip().startswith("|"):
            continue
        for raw in re.findall(r"`([^`]+)`", cells[1]):
            if raw.startswith("scripts/"):
                out.append((raw, raw))
            elif raw.endswith((".py", "/")):
                out.append((f"megatron_mesh_cp/{raw}", raw))
    return out


def test_module_map_entries_exist():
    entries = module_map(README.read_text())
    assert entries
    bad = [raw for path, raw in entries
           if not ((ROOT / path).is_dir() if path.endswith("/") else (ROOT / path).is_file())]
    assert not bad, f"README's module map names what does not exist: {bad}"


def test_module_map_names_every_module_and_script():
    named = {path for path, _ in module_map(README.read_text())}
    modules = [p for p in _walk(PACKAGE) if p.suffix == ".py"]
    scripts = _walk(ROOT / "scripts")
    missing = [_rel(p) for p in modules + scripts if _rel(p) not in named]
    assert not missing, ("README's module map (\"How it is built\") lacks these; add a row for each: "
                         + ", ".join(missing))


def test_the_module_map_check_can_fail():
    text = ("## How it is built\n\n| module | concept |\n|---|---|\n| **`runtime/`** | the layer |\n"
            "| `runtime/plan.py` | plans |\n| `runtime/nowhere.py` | gone |\n| `scripts/env.sh` | env |\n\n## Next\n")
    entries = module_map(text)
    assert [raw for _, raw in entries] == ["runtime/", "runtime/plan.py", "runtime/nowhere.py", "scripts/env.sh"]
    assert [p for p, _ in entries if not (ROOT / p).exists()] == ["megatron_mesh_cp/runtime/nowhere.py"]


@pytest.mark.parametrize("heading, expected", [
    ("How it is built", "how-it-is-built"),
    ("Ulysses × mesh (`a2a+mesh`)", "ulysses--mesh-a2amesh"),
    ("3b. Packed sequences (THD, document masking)", "3b-packed-sequences-thd-document-masking"),
    ("Long-context recipe: Llama-3.1 8B / 70B to 1M tokens on 256 GPUs",
     "long-context-recipe-llama-31-8b--70b-to-1m-tokens-on-256-gpus"),
])
def test_slug_is_githubs(heading, expected):
    assert slug(heading) == expected
