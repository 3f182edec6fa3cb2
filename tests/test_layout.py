"""The package's shape: one op, one stem, in golden/, triton_impl/, tests/, notebooks/, papers.md;
which layer may import which; and every reference in a tracked text file resolves inside the repo
or names a public source."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest

from triton_impl.tolerances import TOLERANCES, markdown_table

ROOT = Path(__file__).resolve().parent.parent
OPS = sorted(p.stem for p in (ROOT / "golden").glob("*.py") if not p.stem.startswith("_"))
EXPECTED_OPS = {"decode_attention", "lse_merge", "mla_verify", "sparse_indices", "turboquant", "ue8m0_cache"}
# Modules of triton_impl/ that are not an op's kernels.
INFRASTRUCTURE = {"__init__", "__main__", "bench", "block_table", "cases", "cli", "interpreter", "launch", "tolerances",
                  "validation"}
# An op's architecture-specific fast path lives beside its portable kernels as ``<op>_sm90.py`` (Gluon, Hopper).
FAST_PATH = "_sm90"


def test_the_ops_are_exactly_these() -> None:
    """Adding or dropping an op is a decision: this list, the README table and papers.md change with it."""
    assert set(OPS) == EXPECTED_OPS, f"golden/ ops: {OPS}"
    kernels = {p.stem for p in (ROOT / "triton_impl").glob("*.py")} - INFRASTRUCTURE
    fast_paths = {k for k in kernels if k.endswith(FAST_PATH)}
    assert {k.removesuffix(FAST_PATH) for k in fast_paths} <= EXPECTED_OPS, f"fast paths of no op: {fast_paths}"
    kernels -= fast_paths
    assert kernels == EXPECTED_OPS, f"triton_impl/ modules that are neither an op nor infrastructure: {kernels}"
    parity = {p.stem for p in (ROOT / "triton_impl" / "parity").glob("*.py")} - {"__init__"}
    assert parity == EXPECTED_OPS, f"triton_impl/parity/ op modules: {sorted(parity)}"
    notebooks = {p.stem for p in (ROOT / "notebooks").glob("*.py")}
    assert notebooks == EXPECTED_OPS, f"notebooks: {sorted(notebooks)}"


@pytest.mark.parametrize("op", OPS)
def test_op_has_all_four_places(op: str) -> None:
    assert (ROOT / "triton_impl" / f"{op}.py").is_file(), f"golden/{op}.py has no triton_impl/{op}.py"
    assert list((ROOT / "tests").glob(f"test_{op}*.py")), f"golden/{op}.py has no tests/test_{op}*.py"
    assert (ROOT / "notebooks" / f"{op}.py").is_file(), f"golden/{op}.py has no notebooks/{op}.py"
    assert (ROOT / "triton_impl" / "parity" / f"{op}.py").is_file(), f"{op} registers no parity cases"
    anchors = re.findall(r"^## (\S+)", (ROOT / "papers.md").read_text(), flags=re.M)
    assert op.replace("_", "-") in anchors, f"papers.md has no '## {op.replace('_', '-')}' section"


def test_papers_cite_tests_that_exist() -> None:
    """Every ``test_*`` that papers.md names as the check of a numeric fact is defined in tests/: a
    renamed test must not leave the bibliography pointing at nothing."""
    cited = set(re.findall(r"`(test_\w+)`", (ROOT / "papers.md").read_text()))
    defined = set(re.findall(r"^def (test_\w+)", "\n".join(p.read_text() for p in (ROOT / "tests").glob("*.py")),
                             flags=re.M))  # fmt: skip
    assert cited, "papers.md cites no tests"
    assert not cited - defined, f"papers.md cites tests that do not exist: {sorted(cited - defined)}"


# -- Import directions --------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _dynamic_prefix(call: ast.Call, own: str) -> str | None:
    """``importlib.import_module(f"{__name__}.{name}")`` imports some module of a package: the
    package's dotted prefix (``own.``), read from the literal start of the argument; else None."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name != "import_module" or not call.args or not isinstance(call.args[0], ast.JoinedStr):
        return None
    prefix = ""
    for part in call.args[0].values:
        if isinstance(part, ast.Constant):
            prefix += str(part.value)
        elif isinstance(part.value, ast.Name) and part.value.id == "__name__":
            prefix += own
        else:
            break
    return prefix if prefix.endswith(".") else None


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth: an import inside a function counts, since it runs too.

    ``from a import b`` yields both ``a`` and ``a.b`` (``b`` may be a module); relative imports are
    resolved against the file's package; ``importlib.import_module(f"pkg.{name}")`` yields ``pkg.*``
    (any module of ``pkg``).
    """
    own = _module_name(path)
    package = own.split(".") if path.stem == "__init__" else own.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and (prefix := _dynamic_prefix(node, own)):
            found.add(prefix + "*")
    return found


def _imports_any(path: Path, prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in _imports(path) if any(m == p or m.startswith(p + ".") for p in prefixes))


GOLDEN_FILES = sorted((ROOT / "golden").glob("*.py"))
# triton_impl/*.py that kernels are built from or that ship kernels; the runners above them may
# call golden models (parity/ checks against them).
KERNEL_SIDE = sorted(p for p in (ROOT / "triton_impl").glob("*.py") if p.stem not in {"bench", "cli", "__main__"})


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=[p.name for p in GOLDEN_FILES])
def test_golden_never_calls_triton(path: Path) -> None:
    """The definition stands alone: a golden model built on a kernel or its helpers checks nothing."""
    assert not _imports_any(path, ("triton", "triton_impl")), f"golden/{path.name} imports Triton code"


@pytest.mark.parametrize("path", KERNEL_SIDE, ids=[p.name for p in KERNEL_SIDE])
def test_kernels_never_import_golden(path: Path) -> None:
    """A helper shared by a kernel and its golden twin would carry one bug into both: the
    kernel-vs-golden tests could not see it. Only the runners (parity/, bench) read golden."""
    found = _imports_any(path, ("golden",))
    assert not found, f"triton_impl/{path.name} imports {found}; give the kernel side its own copy"


# Layers, bottom up: triton_impl/cases.py (checks, paged-cache builders) < triton_impl/bench.py (the
# timing runner) < triton_impl/parity/ (parity runner and every op's cases, bench cases included)
# < triton_impl/cli.py. tests/support.py builds on the package, never on its runners.
LAYER_RULES = [
    ("triton_impl/cases.py", ("triton_impl.bench", "triton_impl.parity", "triton_impl.cli", "golden")),
    ("triton_impl/bench.py", ("triton_impl.parity", "triton_impl.cli", "golden")),
    ("tests/support.py", ("triton_impl.parity", "triton_impl.bench", "triton_impl.cli")),
]


@pytest.mark.parametrize(("file", "forbidden"), LAYER_RULES, ids=[f for f, _ in LAYER_RULES])
def test_layers_import_only_downwards(file: str, forbidden: tuple[str, ...]) -> None:
    found = _imports_any(ROOT / file, forbidden)
    assert not found, f"{file} imports {found}, a layer above it (or beside it)"


def _shortest_cycle(edges: dict[str, set[str]], start: str) -> list[str] | None:
    paths = {start: [start]}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(edges[node]):
            if nxt == start:
                return [*paths[node], start]
            if nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                queue.append(nxt)
    return None


def test_triton_impl_has_no_import_cycle() -> None:
    """No cycle among triton_impl's modules, lazy imports included (a lazy import only hides one).

    Importing a module first runs its packages' ``__init__``, so those count as imported too,
    except the importer's own packages, which are running already. A registry that imports its
    package's modules by name (``importlib``) imports every one of them.
    """
    files = {_module_name(p): p for p in (ROOT / "triton_impl").rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in files.items():
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        imported = set()
        for module in _imports(path):
            targets = {m for m in files if m.startswith(module[:-1])} if module.endswith("*") else {module}
            for target in targets & files.keys():
                parts = target.split(".")
                imported.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        edges[name] = imported - own
    cycles = {}
    for name in sorted(files):
        cycle = _shortest_cycle(edges, name)
        if cycle:
            cycles.setdefault(frozenset(cycle), " -> ".join(files[m].relative_to(ROOT).as_posix() for m in cycle))
    assert not cycles, "import cycles:\n" + "\n".join(cycles.values())


# -- References -----------------------------------------------------------------------------------


def _git(*args: str, cwd: Path = ROOT, **kwargs) -> subprocess.CompletedProcess:
    """``git args`` run in ``cwd``, its output captured as text."""
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=60, **kwargs)


def _tracked_text_files() -> list[str]:
    """Tracked ``*.py``, ``*.md``, ``.ci/*`` and ``pyproject.toml``; a walk where there is no git
    checkout (the GPU machine gets the files without ``.git``)."""
    try:
        listed = _git("ls-files", check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        skip = {"__pycache__", "build", "dist", "gpu_out"}
        listed = [
            p.relative_to(ROOT).as_posix()
            for p in ROOT.rglob("*")
            if p.is_file()
            and not any(
                (part.startswith(".") and part != ".ci") or part in skip or part.endswith(".egg-info")
                for part in p.relative_to(ROOT).parts[:-1]
            )
        ]
    return sorted(
        f
        for f in listed
        if (f.endswith((".py", ".md")) or f.startswith(".ci/") or f == "pyproject.toml") and (ROOT / f).is_file()
    )


TEXT_FILES = _tracked_text_files()
REPO_BASENAMES = {Path(f).name for f in TEXT_FILES}

# Documents a reader of the repo does not have. The patterns are written so this file's own source
# does not match them.
OUTSIDE = [
    (
        re.compile(r"\bspec(?:ification)?(?:'s)? sections? \d|\bsections? \d[\d.]* of the spec", re.I),
        "a section of a spec that is not in the repo: carry what it says into a docstring or README section",
    ),
    (re.compile(r"\bS[P]EC\b"), "the project spec is not in the repo: cite the docstring, README or papers.md"),
    (re.compile(r"\bissue[ -]?\d", re.I), "an issue of an unnamed tracker: write owner/repo#N or carry the facts"),
    (re.compile(r"\bseed 00\d", re.I), "a seed document not in the repo: name the upstream file and commit"),
    (re.compile(r"\b(?:METHOD|KINDS)\.md\b"), "a document of the GPU tooling, not of the repo"),
    (re.compile(r"\.\./shared"), "a folder outside the repo"),
    (re.compile(r"\bB\d{1,2}\.\d{1,2}\b"), "a numbered fact of an unpublished list: state the fact and its source"),
]
# A path into one of the repo's folders. Not preceded by a path character or ':', so an upstream
# file written as owner/repo:tests/x.py, or vllm/tests/x.py, is not taken for one of ours.
REPO_DIRS = ("golden/", "triton_impl/", "tests/", "notebooks/", "benchmarks/", ".ci/")
_PATH_START = r"(?<![\w./:-])"
REPO_PATH = re.compile(_PATH_START + "((?:" + "|".join(map(re.escape, REPO_DIRS)) + r")[\w./-]*)")
LINE_REF = re.compile(_PATH_START + r"([\w./-]+\.py):(\d+)\b")
TEMPLATE_CHARS = ("{", "<", "*", "[", "$")  # golden/<op>.py, tests/test_{op}*.py: a pattern, not a file


def _offenders(name: str, text: str) -> list[str]:
    """``name:line: what`` for each outside reference and each reference to a repo file that is not there."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        where = f"{name}:{number}"
        reported: list[range] = []  # one report per span: a spec section is not also a bare spec
        for pattern, why in OUTSIDE:
            for m in pattern.finditer(line):
                if not any(m.start() in span or m.end() - 1 in span for span in reported):
                    reported.append(range(m.start(), m.end()))
                    found.append(f"{where}: {m.group(0)!r}: {why}")
        for m in REPO_PATH.finditer(line):
            if line[m.end() : m.end() + 1] in TEMPLATE_CHARS:
                continue
            path = m.group(1).rstrip(".")
            if not (ROOT / path).exists():
                found.append(f"{where}: {path!r} does not exist (moved? an upstream file is written owner/repo:path)")
        for m in LINE_REF.finditer(line):
            path = m.group(1)
            if path.startswith(REPO_DIRS) or path in REPO_BASENAMES or (ROOT / path).is_file():
                found.append(f"{where}: {m.group(0)!r}: a line number in this repo drifts; name the function")
    return found


@pytest.mark.parametrize("rel", TEXT_FILES)
def test_references_resolve_inside_the_repo(rel: str) -> None:
    """Every reference in a tracked text file points inside the repo (a file that exists, a
    docstring, a README section, a papers.md anchor) or names a public source (paper, upstream
    file and commit): a reader has nothing else."""
    found = _offenders(rel, (ROOT / rel).read_text(errors="replace"))
    assert not found, f"{len(found)} unresolved references:\n" + "\n".join(found)


def test_the_reference_check_sees_each_kind() -> None:
    """Negative control: one offender of each kind is reported, with its line; patterns are not."""
    lines = [
        "see " + "S" + "PEC section 3",
        "the " + "issue" + " 7 targets",
        "seed" + " 001",
        "METHOD" + ".md",
        "../" + "shared/notes.md",
        "facts B" + "2.9",
        "`notebooks/results/" + "no_such_file.md`",
        "``tests/" + "no_such_test.py``",
        "triton_impl/cases.py" + ":12",
        "bench.py" + ":7",
    ]
    found = _offenders("probe.md", "\n".join(lines))
    assert {int(f.split(":")[1]) for f in found} == set(range(1, len(lines) + 1)), found
    fine = "`golden/<op>.py`, `tests/test_{op}*.py`, deepseek-ai/FlashMLA:tests/quant.py, FLUTE section 3.2, a/x.py:9"
    assert _offenders("probe.md", fine) == []


# -- Tolerances -----------------------------------------------------------------------------------


def test_every_tolerance_has_a_reason_and_a_known_op() -> None:
    for (op, _output, _dtype), tol in TOLERANCES.items():
        assert op in OPS, f"tolerance entry for unknown op {op!r}"
        assert len(tol.reason) > 20, f"{op}: give the reason for the tolerance"


def test_tolerance_doc_is_current() -> None:
    doc = (ROOT / "tests" / "TOLERANCES.md").read_text()
    assert doc == markdown_table(), "regenerate: python -m triton_impl tolerances > tests/TOLERANCES.md"


# -- Kernel variants kept as patches ------------------------------------------------------------------


def test_every_variant_patch_applies_at_its_base(tmp_path: Path) -> None:
    """Each patch of ``benchmarks/variants/`` applies to the files of the commit its first line names (``Base:
    <commit>``, else HEAD), as ``benchmarks/variants/unpack.sh`` applies it: the archive of variants not landed can
    be timed again. A patch that no longer applies at HEAD gets the commit it was written against."""
    try:
        checkout = _git("rev-parse", "HEAD").returncode == 0
    except OSError:  # no git at all
        checkout = False
    if not checkout:
        pytest.skip("not a git checkout")
    patches = sorted((ROOT / "benchmarks" / "variants").glob("*.patch"))
    assert patches
    for patch in patches:
        first = patch.read_text().split("\n", 1)[0]
        base = first.removeprefix("Base: ") if first.startswith("Base: ") else "HEAD"
        if _git("cat-file", "-e", f"{base}^{{commit}}").returncode:
            pytest.skip(f"{patch.name}: its base {base} is not in this clone's history")
        where = tmp_path / patch.stem
        for name in _git("apply", "--numstat", str(patch), check=True).stdout.split("\n"):
            if not name.strip():
                continue
            file = name.split("\t")[2]
            shown = _git("show", f"{base}:{file}")
            if shown.returncode == 0:  # (a file the patch creates is not at its base)
                (where / file).parent.mkdir(parents=True, exist_ok=True)
                (where / file).write_text(shown.stdout)
        where.mkdir(exist_ok=True)
        applied = _git("apply", "--check", str(patch), cwd=where)
        assert applied.returncode == 0, f"{patch.name} at {base}: {applied.stderr}"


# -- The README's example -----------------------------------------------------------------------------


def test_readme_python_examples_run() -> None:
    """Every ```python block of the README runs as printed, in a fresh interpreter from the repository root (the
    example checks a kernel against its golden model and asserts the result)."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks, "the README lost its example"
    for block in blocks:
        done = subprocess.run([sys.executable, "-c", block], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "max |error|" in done.stdout, done.stdout
