#!/usr/bin/env python3
"""Release day's drift check: does the newest vLLM / SGLang on PyPI still have
the code dpcoord wraps and the wire formats dpcoord reads, as in the newest
release dpcoord is tested with? Run by .ci/engines-drift (never by CI: it
depends on what PyPI has today).

    .venv/bin/python .ci/engines_drift.py [--vllm VERSION] [--sglang VERSION]

Each checked release is installed with ``pip install --no-deps --target`` into
``.venv/drift/<package>-<version>`` (kept for the next run). Its sources are
read, never imported:

* the route hooks' seams (``dpcoord.vllm_route`` and ``dpcoord.sglang_route``:
  ``SEAMS`` and ``TESTED``): each method's source, exactly as
  ``inspect.getsource`` returns it, is fingerprinted as the hook does at start;
  a changed one is shown as a unified diff against the tested release's;
* the wire formats: the msgspec Structs of the KV events (vLLM's and SGLang's)
  and of SGLang's load stream, field by field in wire order;
* the fields of vLLM's stats objects that the stat-logger plugin and the route
  hook read, and the ``/metrics`` families the daemon's scraper reads.

Then the compat suite's vLLM tests run on the checked vLLM. Exit status: 0 when
nothing changed and the tests pass, 1 when anything drifted, 2 on the check's
own errors (no network, a release pip cannot install, ...).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import hashlib
import importlib
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import tokenize
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
COMPAT = ROOT / "clients" / "python" / "tests" / "compat"
METRICS_RS = ROOT / "crates" / "daemon" / "src" / "wire" / "vllm_metrics"
VLLM_TESTS = ("test_vllm_route.py", "test_vllm_books.py", "test_vllm_plugin.py")
#: the longest one of those tests may run here (each takes seconds; on a release
#: the hook refuses, a test may wait for a query that never comes)
TEST_TIMEOUT_S = 60


def venv() -> Path:
    """The project's virtualenv (``DPCOORD_VENV``, as for .ci/test; default .venv)."""
    path = Path(os.environ.get("DPCOORD_VENV", ".venv"))
    return path if path.is_absolute() else ROOT / path


class CheckError(Exception):
    """The check itself could not run (exit status 2)."""


# -- releases ----------------------------------------------------------------------


def newest_on_pypi(package: str) -> str:
    """The newest release of ``package`` on PyPI (pre-releases left out)."""
    out = _pip("index", "versions", package)
    found = re.search(rf"^{re.escape(package)} \(([^)]+)\)", out, re.M)
    if found is None:
        raise CheckError(f"pip index versions {package} named no release:\n{out}")
    return found.group(1)


def _pip(*args: str) -> str:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise CheckError(f"{' '.join(cmd[2:])} failed ({done.returncode}):\n{done.stderr.strip()}")
    return done.stdout


def installed(folder: Path, package: str) -> str | None:
    """The version of ``package`` installed in ``folder`` (a site-packages or a
    ``pip install --target`` folder), from its dist-info; None if there is none."""
    dists = sorted(folder.glob(f"{package}-*.dist-info"))
    return dists[0].name[len(package) + 1 : -len(".dist-info")] if dists else None


def site_packages() -> Path:
    """The virtualenv's site-packages (where requirements.txt's pins are installed)."""
    lib = sorted((venv() / "lib").glob("python3*/site-packages"))
    return lib[0] if lib else Path(sysconfig.get_paths()["purelib"])


def install(package: str, version: str) -> Path:
    """``.venv/drift/<package>-<version>``, installed there with ``pip --no-deps
    --target`` unless it already is (an interrupted install is never reused)."""
    folder = venv() / "drift" / f"{package}-{version}"
    if installed(folder, package) == version:
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    print(f"engines-drift: installing {package}=={version} into {folder}", file=sys.stderr, flush=True)
    work = Path(tempfile.mkdtemp(prefix=f".{package}-{version}.", dir=folder.parent))
    try:
        _pip("install", "--quiet", "--no-deps", "--only-binary=:all:", "--target", str(work), f"{package}=={version}")
        if installed(work, package) != version:
            raise CheckError(f"pip installed no {package} {version} into {work}")
        shutil.rmtree(folder, ignore_errors=True)
        work.chmod(0o755)  # mkdtemp's is 0700
        work.rename(folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder


def release_folder(package: str, version: str) -> Path:
    """Where ``package`` ``version`` is installed: the virtualenv's site-packages,
    .ci/test's ``.venv/vllm/<version>``, or ``.venv/drift`` (installed now if need be)."""
    candidates = [site_packages(), venv() / package / version, venv() / "drift" / f"{package}-{version}"]
    for folder in candidates:
        if installed(folder, package) == version:
            return folder
    return install(package, version)


def newest(versions: Iterable[str]) -> str:
    return max(versions, key=Version)


def pinned(package: str) -> str:
    """The release of ``package`` the compat suite installs in the virtualenv."""
    for line in (COMPAT / "requirements.txt").read_text().splitlines():
        if line.startswith(f"{package}=="):
            return line.split("==", 1)[1].strip()
    raise CheckError(f"compat/requirements.txt pins no {package}")


# -- reading a release's sources ---------------------------------------------------------


@lru_cache(maxsize=None)
def _lines(path: Path) -> tuple[str, ...]:
    """The lines of ``path`` as ``linecache`` (and so ``inspect``) reads them."""
    with tokenize.open(path) as f:
        return tuple(f.readlines())


@lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse("".join(_lines(path)), str(path))


def module_file(folder: Path, module: str) -> Path | None:
    base = folder.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _module_of(folder: Path, path: Path) -> str:
    parts = path.relative_to(folder).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def find_class(folder: Path, path: Path, name: str, depth: int = 0) -> tuple[Path, ast.ClassDef] | None:
    """The class ``name`` as module ``path`` sees it: defined there, or imported
    there with ``from ... import`` from another module of ``folder``."""
    if depth > 8:
        return None
    tree = _tree(path)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return path, node
    for node in tree.body:
        if not isinstance(node, ast.ImportFrom):
            continue
        for alias in node.names:
            if (alias.asname or alias.name) != name:
                continue
            module = node.module or ""
            if node.level:
                package = _module_of(folder, path).split(".")
                if path.name != "__init__.py":
                    package = package[:-1]
                package = package[: len(package) - node.level + 1]
                module = ".".join(package + ([module] if module else []))
            source = module_file(folder, module)
            if source is not None:
                return find_class(folder, source, alias.name, depth + 1)
    return None


def search_class(folder: Path, package: str, name: str) -> tuple[Path, ast.ClassDef] | None:
    """The first module of ``package`` in ``folder`` that defines class ``name``."""
    pattern = re.compile(rf"^class {re.escape(name)}\b", re.M)
    for path in sorted((folder / package).rglob("*.py")):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        if pattern.search(text):
            found = find_class(folder, path, name)
            if found is not None:
                return found
    return None


def locate_class(folder: Path, relpath: str, name: str) -> tuple[Path, ast.ClassDef] | None:
    """Class ``name`` in ``relpath`` of ``folder``, else wherever its package defines it."""
    path = folder / relpath
    found = find_class(folder, path, name) if path.is_file() else None
    return found or search_class(folder, relpath.split("/")[0], name)


def _bases(folder: Path, path: Path, cls: ast.ClassDef) -> list[tuple[Path, ast.ClassDef]]:
    """The bases of ``cls`` found in ``folder``'s sources, left to right."""
    found = []
    for base in cls.bases:
        if isinstance(base, ast.Name) and (hit := find_class(folder, path, base.id)) is not None:
            found.append(hit)
    return found


def method_source(folder: Path, module: str, qualname: str) -> tuple[str, str] | None:
    """``(where, source)`` of ``Class.method`` of ``module`` in ``folder``: the text
    ``inspect.getsource`` gives for it (from its first decorator to the end of its
    block), found in the class or, as ``getattr`` finds it, in its bases."""
    cls_name, method = qualname.split(".")
    path = module_file(folder, module)
    found = find_class(folder, path, cls_name) if path is not None else None
    seen = set()
    todo = [found] if found else []
    while todo:
        path, cls = todo.pop(0)
        if (path, cls.name) in seen:
            continue
        seen.add((path, cls.name))
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == method:
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                source = "".join(inspect.getblock(list(_lines(path)[first - 1 :])))
                return f"{path.relative_to(folder)} {cls.name}.{method}", source
        todo.extend(_bases(folder, path, cls))
    return None


def fingerprint(source: str) -> str:
    """As ``dpcoord.vllm_route.fingerprint``, of the source text itself."""
    return hashlib.sha256(source.encode()).hexdigest()[:16]


# -- findings ----------------------------------------------------------------------


@dataclass
class Finding:
    """One seam, format or family: its status and, when changed, why."""

    name: str
    status: str  # unchanged / changed, present / missing
    detail: str = ""
    diff: list[str] = field(default_factory=list)

    @property
    def drifted(self) -> bool:
        return self.status in ("changed", "missing")


@dataclass
class Section:
    """A group of findings of one engine, e.g. its hook's seams."""

    title: str
    kind: str  # seams / formats / families
    findings: list[Finding] = field(default_factory=list)
    note: str = ""


def _diff(old: list[str], new: list[str], old_name: str, new_name: str) -> list[str]:
    return [line.rstrip("\n") for line in difflib.unified_diff(old, new, old_name, new_name, n=3)]


# -- seams -------------------------------------------------------------------------


def hook_tables(module: str) -> tuple[tuple[tuple[str, str], ...], dict[str, dict[str, str]]] | None:
    """``(SEAMS, TESTED)`` of dpcoord's hook ``module``; None if there is no such
    module. A module without them is the check's own error."""
    try:
        hook = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            return None
        raise CheckError(f"importing {module} failed: {e!r}") from e
    except Exception as e:  # noqa: BLE001 - dpcoord's own module must import
        raise CheckError(f"importing {module} failed: {e!r}") from e
    seams, tested = getattr(hook, "SEAMS", None), getattr(hook, "TESTED", None)
    if not seams or not tested:
        raise CheckError(f"{module} has no SEAMS and TESTED to check")
    return tuple(seams), dict(tested)


def seam_names(seams: Iterable[tuple[str, str]], expected: dict[str, str]) -> list[tuple[str, str]]:
    """``(module, "Class.method")`` of every seam, then of each other method the
    fingerprints cover (in the module of a seam of the same class)."""
    seams = list(seams)
    names = [name for _, name in seams]
    for name in expected:
        if name not in names:
            cls = name.split(".")[0]
            module = next((m for m, n in seams if n.split(".")[0] == cls), seams[0][0])
            seams.append((module, name))
    return seams


def compare_seams(
    package: str,
    seams: Iterable[tuple[str, str]],
    expected: dict[str, str],
    checked: Path,
    baseline: Path,
) -> list[Finding]:
    """Each seam of ``checked`` against its tested fingerprint in ``expected``, with
    a diff against its source in ``baseline`` (the tested release) when changed."""
    old_release, new_release = installed(baseline, package), installed(checked, package)
    out = []
    for module, name in seam_names(seams, expected):
        new = method_source(checked, module, name)
        old = method_source(baseline, module, name)
        want = expected.get(name)
        if new is None:
            out.append(Finding(name, "changed", f"not found in {module}", []))
            continue
        got = fingerprint(new[1])
        if want is not None and got == want:
            out.append(Finding(name, "unchanged", got))
            continue
        detail = f"{want or 'untested'} -> {got}"
        if old is not None and fingerprint(old[1]) != want:
            detail += f" (the tested source in {package} {old_release} is {fingerprint(old[1])}: TESTED is stale)"
        diff = (
            _diff(
                old[1].splitlines(True),
                new[1].splitlines(True),
                f"{package} {old_release}: {old[0]}",
                f"{package} {new_release}: {new[0]}",
            )
            if old is not None
            else []
        )
        out.append(Finding(name, "changed", detail, diff))
    return out


# -- wire formats ------------------------------------------------------------------

#: msgspec options that change what a Struct looks like on the wire
WIRE_OPTIONS = ("array_like", "tag", "tag_field", "rename", "omit_defaults")


def _is_classvar(annotation: ast.expr) -> bool:
    text = ast.unparse(annotation)
    return text.startswith(("ClassVar", "typing.ClassVar"))


def struct_layout(folder: Path, relpath: str, name: str) -> tuple[str, list[str]] | None:
    """Where msgspec Struct ``name`` is defined, and its wire layout: a line of
    its options, then its fields in msgspec's order (inherited fields first, a
    redefined field keeps its place, keyword-only fields last). None if no
    module of the package defines it."""
    found = locate_class(folder, relpath, name)
    if found is None:
        return None
    path, cls = found
    fields: dict[str, bool] = {}  # name -> keyword-only
    options: dict[str, str] = {}

    def collect(path: Path, cls: ast.ClassDef) -> None:
        for base in _bases(folder, path, cls)[::-1]:
            collect(*base)
        keywords = {k.arg: ast.unparse(k.value) for k in cls.keywords if k.arg}
        options.update({k: v for k, v in keywords.items() if k in WIRE_OPTIONS})
        kw_only = keywords.get("kw_only") == "True"
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and not _is_classvar(node.annotation):
                fields[node.target.id] = kw_only

    collect(path, cls)
    options = {k: v for k, v in options.items() if v not in ("False", "None")}  # msgspec's defaults
    if options.get("tag") == "True":
        options["tag"] = repr(cls.name)
    head = "options: " + (", ".join(f"{k}={options[k]}" for k in WIRE_OPTIONS if k in options) or "none")
    order = [f for f, kw in fields.items() if not kw] + [f for f, kw in fields.items() if kw]
    return str(path.relative_to(folder)), [head] + order


@dataclass(frozen=True)
class Format:
    """A wire format dpcoord reads: Structs of a package's module."""

    title: str
    package: str
    relpath: str  # where the tested release defines them
    structs: tuple[str, ...]


VLLM_FORMATS = (
    Format(
        "KV events",
        "vllm",
        "vllm/distributed/kv_events.py",
        ("KVEventBatch", "BlockStored", "BlockRemoved", "AllBlocksCleared"),
    ),
)
SGLANG_FORMATS = (
    Format(
        "KV events",
        "sglang",
        "sglang/srt/disaggregation/kv_events.py",
        ("KVEventBatch", "BlockStored", "BlockRemoved", "AllBlocksCleared"),
    ),
    Format("load stream", "sglang", "sglang/srt/managers/scheduler_components/load_publisher.py", ("LoadStat",)),
)


def compare_format(fmt: Format, checked: Path, baseline: Path) -> list[Finding]:
    """Each Struct of ``fmt`` in ``checked`` against ``baseline``, field by field."""
    old_release, new_release = installed(baseline, fmt.package), installed(checked, fmt.package)
    out = []
    for name in fmt.structs:
        old = struct_layout(baseline, fmt.relpath, name)
        new = struct_layout(checked, fmt.relpath, name)
        if old is None:
            raise CheckError(f"{fmt.package} {old_release} defines no {name} (is {fmt.relpath} still where it is?)")
        if new is None:
            out.append(Finding(name, "changed", f"no module of {fmt.package} {new_release} defines it"))
            continue
        moved = f", now in {new[0]}" if new[0] != old[0] else ""
        if new[1] == old[1]:
            out.append(Finding(name, "unchanged", f"{len(new[1]) - 1} fields; {new[1][0]}{moved}"))
            continue
        diff = _diff(
            [f"{line}\n" for line in old[1]],
            [f"{line}\n" for line in new[1]],
            f"{fmt.package} {old_release}: {old[0]} {name}",
            f"{fmt.package} {new_release}: {new[0]} {name}",
        )
        out.append(Finding(name, "changed", f"{len(old[1]) - 1} -> {len(new[1]) - 1} fields{moved}", diff))
    return out


# -- vLLM's stats objects ----------------------------------------------------------

STATS_MODULE = "vllm/v1/metrics/stats.py"
#: the attributes dpcoord reads of vLLM's stats objects (``a|b``: either one):
#: vllm_plugin.vllm_gauges and vllm_step, and vllm_route.Hook.delivered
STATS_READ: dict[str, tuple[str, ...]] = {
    "SchedulerStats": ("num_waiting_reqs", "num_skipped_waiting_reqs", "num_running_reqs", "kv_cache_usage|gpu_cache_usage"),
    "IterationStats": ("finished_requests", "time_to_first_tokens_iter", "inter_token_latencies_iter"),
    "FinishedRequestStats": ("finish_reason",),
    "PrefillStats": ("num_cached_tokens",),
}


def attributes(folder: Path, relpath: str, name: str) -> tuple[str, set[str]] | None:
    """Where class ``name`` is defined, and the attributes its instances have:
    annotated class fields, ``self.x`` set in ``__init__``, properties, with its
    bases'. None if no module of the package defines it."""
    found = locate_class(folder, relpath, name)
    if found is None:
        return None
    names: set[str] = set()
    todo = [found]
    while todo:
        path, cls = todo.pop()
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                decorators = {ast.unparse(d) for d in node.decorator_list}
                if decorators & {"property", "cached_property", "functools.cached_property"}:
                    names.add(node.name)
                if node.name == "__init__":
                    for sub in ast.walk(node):
                        if isinstance(sub, ast.Assign):
                            targets = sub.targets
                        else:
                            targets = [sub.target] if isinstance(sub, ast.AnnAssign) else []
                        for t in targets:
                            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                                names.add(t.attr)
        todo.extend(_bases(folder, path, cls))
    return str(found[0].relative_to(folder)), names


def compare_stats(checked: Path, baseline: Path) -> list[Finding]:
    """Whether each stats object still has the attributes dpcoord reads."""
    old_release, new_release = installed(baseline, "vllm"), installed(checked, "vllm")
    out = []
    for name, reads in STATS_READ.items():
        old = attributes(baseline, STATS_MODULE, name)
        new = attributes(checked, STATS_MODULE, name)
        if old is None:
            raise CheckError(f"vllm {old_release} defines no {name}")
        if new is None:
            out.append(Finding(name, "changed", f"no module of vllm {new_release} defines it"))
            continue

        def present(attrs: set[str]) -> list[str]:
            return [r for r in reads if any(a in attrs for a in r.split("|"))]

        moved = f", now in {new[0]}" if new[0] != old[0] else ""
        had, has = present(old[1]), present(new[1])
        if has == had and len(has) == len(reads):
            out.append(Finding(name, "unchanged", ", ".join(reads) + moved))
            continue
        missing = [r for r in reads if r not in has]
        diff = _diff(
            [f"{r}\n" for r in had],
            [f"{r}\n" for r in has],
            f"vllm {old_release}: {old[0]} {name} (attributes dpcoord reads)",
            f"vllm {new_release}: {new[0]} {name}",
        )
        out.append(Finding(name, "changed", "missing: " + ", ".join(missing) + moved, diff))
    return out


# -- /metrics families -------------------------------------------------------------


def scraped_families(source: Path = METRICS_RS) -> list[str]:
    """The vLLM ``/metrics`` families the daemon's scraper reads (its ``&str`` consts)."""
    names: list[str] = []
    for path in sorted(source.glob("*.rs")):
        for name in re.findall(r'const\s+\w+\s*:\s*&str\s*=\s*"(vllm:[^"]+)"', path.read_text()):
            if name not in names:
                names.append(name)
    if not names:
        raise CheckError(f"found no vllm: family in {source}")
    return names


def exported_families(folder: Path) -> dict[str, str]:
    """family -> module, for each metric vLLM's metrics modules make: a call with a
    ``vllm:`` name whose callee says what it is (a counter is exported as
    ``<name>_total``, a histogram as ``_bucket``, ``_sum`` and ``_count`` too)."""
    out: dict[str, str] = {}
    for path in sorted((folder / "vllm" / "v1" / "metrics").glob("*.py")):
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.Call):
                continue
            named = [k.value for k in node.keywords if k.arg == "name"] + node.args[:1]
            name = next((n.value for n in named if isinstance(n, ast.Constant) and isinstance(n.value, str)), None)
            if name is None or not name.startswith("vllm:"):
                continue
            callee = ast.unparse(node.func).lower()
            where = str(path.relative_to(folder))
            if "counter" in callee:
                stem = name.removesuffix("_total")
                names = [stem, f"{stem}_total"]
            elif "histogram" in callee:
                names = [name] + [f"{name}_{s}" for s in ("bucket", "sum", "count")]
            else:
                names = [name]
            for n in names:
                out.setdefault(n, where)
    return out


def check_families(families: Iterable[str], checked: Path) -> list[Finding]:
    """``present`` / ``missing`` for each family in the ``checked`` release."""
    exported = exported_families(checked)
    missing = "made by no module of vllm/v1/metrics"
    return [Finding(n, "present", exported[n]) if n in exported else Finding(n, "missing", missing) for n in families]


# -- the compat suite --------------------------------------------------------------


@dataclass
class TestRun:
    status: str  # passed / failed / not run
    counts: dict[str, int] = field(default_factory=dict)
    summary: str = ""
    failures: list[str] = field(default_factory=list)
    log: Path | None = None
    #: the failed tests that passed when run again
    flaky: list[str] = field(default_factory=list)

    @property
    def drifted(self) -> bool:
        return self.status == "failed"

    @property
    def failed_ids(self) -> list[str]:
        """The node ids of :attr:`failures`."""
        return [line.split(" ", 1)[1].split(" - ", 1)[0] for line in self.failures]

    def brief(self) -> str:
        if not self.counts:
            return self.status
        flaky = f" ({len(self.flaky)} passed again: flaky)" if self.flaky else ""
        return ", ".join(f"{n} {k}" for k, n in self.counts.items()) + flaky


def dpcoord_binary() -> str:
    """``DPCOORD_BIN``, else target/release/dpcoord, brought up to date with
    ``cargo build --release`` (a binary older than the checkout fails tests that
    are not about the engine); without cargo, the binary as it is."""
    if os.environ.get("DPCOORD_BIN"):
        return os.environ["DPCOORD_BIN"]
    meta = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--no-deps"], cwd=ROOT, capture_output=True, text=True
    ) if shutil.which("cargo") else None
    if meta is None or meta.returncode != 0:
        binary = ROOT / "target" / "release" / "dpcoord"
        if not binary.exists():
            raise CheckError(f"no {binary} and no cargo to build it (DPCOORD_BIN names a dpcoord binary)")
        print(f"engines-drift: no cargo: the tests use {binary} as it is", file=sys.stderr, flush=True)
        return str(binary)
    print("engines-drift: cargo build --release --bin dpcoord", file=sys.stderr, flush=True)
    if subprocess.run(["cargo", "build", "--quiet", "--release", "--bin", "dpcoord"], cwd=ROOT).returncode != 0:
        raise CheckError("cargo build --release --bin dpcoord failed")
    return str(Path(json.loads(meta.stdout)["target_directory"]) / "release" / "dpcoord")


def run_vllm_tests(home: Path, binary: str) -> TestRun:
    """The compat suite's vLLM tests on the vLLM installed in ``home``, each
    stopped after :data:`TEST_TIMEOUT_S` (this module is their pytest plugin).
    Failed tests run once more: one that passes then is flaky, not drift."""
    run = _pytest(home, binary, [str((COMPAT / t).relative_to(ROOT)) for t in VLLM_TESTS], "pytest", "the vLLM tests")
    if run.status == "failed" and run.failed_ids:
        again = _pytest(home, binary, run.failed_ids, "pytest-again", f"the {len(run.failed_ids)} failed again")
        still = set(again.failed_ids) if again.counts else set(run.failed_ids)
        run.flaky = [t for t in run.failed_ids if t not in still]
        if not still:
            run.status = "passed"
    return run


def _pytest(home: Path, binary: str, tests: list[str], name: str, what: str) -> TestRun:
    log = home.parent / f"{home.name}.{name}.log"
    cmd = [str(venv() / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "engines_drift", *tests]
    path = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "DPCOORD_VLLM_HOME": str(home), "DPCOORD_BIN": binary, "PYTHONPATH": path}
    print(f"engines-drift: running {what} on {home.name} (log: {log})", file=sys.stderr, flush=True)
    with open(log, "w") as out:
        try:
            done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=3600)
        except subprocess.TimeoutExpired:
            return TestRun("failed", summary="timed out after an hour", log=log)
    return parse_pytest(done.returncode, log.read_text(errors="replace"), log)


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    """As a pytest plugin: a test still running after :data:`TEST_TIMEOUT_S` fails."""

    def expired(signum: int, frame: Any) -> None:
        raise TimeoutError(f"{nodeid} still ran after {TEST_TIMEOUT_S} s (engines-drift's limit)")

    signal.signal(signal.SIGALRM, expired)
    signal.alarm(TEST_TIMEOUT_S)


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    signal.alarm(0)


def parse_pytest(returncode: int, output: str, log: Path | None = None) -> TestRun:
    """Counts, the summary line and the failed tests of a ``pytest -q`` run."""
    lines = output.splitlines()
    summary = next((l.strip("= ") for l in reversed(lines) if re.search(r"\d+ (passed|failed|error)", l)), "")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)", summary)}
    failures = [l for l in lines if re.match(r"(FAILED|ERROR) \S+\.py", l)]
    status = "passed" if returncode == 0 else "failed"
    if returncode != 0 and not summary:
        summary = lines[-1] if lines else f"pytest exited with {returncode}"
    return TestRun(status, counts, summary, failures, log)


# -- the report --------------------------------------------------------------------


@dataclass
class Engine:
    name: str  # vLLM / SGLang
    package: str
    checked: str
    tested: str
    #: how ``checked`` was chosen: "the newest on PyPI", or the option naming it
    chosen: str = "the newest on PyPI"
    sections: list[Section] = field(default_factory=list)
    tests: TestRun = field(default_factory=lambda: TestRun("not run"))

    def count(self, kind: str, status: str) -> int:
        return sum(f.status == status for s in self.sections if s.kind == kind for f in s.findings)

    @property
    def drifted(self) -> bool:
        return self.tests.drifted or any(f.drifted for s in self.sections for f in s.findings)


def untested_note(engine: str, release: str, tested: dict[str, dict[str, str]]) -> str:
    """What to do for a release the hook does not know, changed or not."""
    if release in tested:
        return ""
    return f"{engine} {release} is not in TESTED: the hook stays out of it until it joins the support window"


def format_sections(formats: Iterable[Format], checked: Path, baseline: Path) -> list[Section]:
    """One section per wire format, ``checked`` against ``baseline``."""
    return [Section(f"wire format: {f.title} ({f.relpath})", "formats", compare_format(f, checked, baseline)) for f in formats]


def check_vllm(checked_release: str) -> Engine:
    """vLLM ``checked_release`` against the newest release the route hook is
    tested with: seams, formats, stats objects, families, then the tests."""
    tables = hook_tables("dpcoord.vllm_route")
    if tables is None:
        raise CheckError("dpcoord.vllm_route is missing")
    seams, tested = tables
    engine = Engine("vLLM", "vllm", checked_release, newest(tested))
    checked = install("vllm", checked_release)
    baseline = release_folder("vllm", engine.tested)
    engine.sections.append(
        Section(
            f"the route hook's seams (dpcoord.vllm_route), fingerprints of {engine.tested}",
            "seams",
            compare_seams("vllm", seams, tested[engine.tested], checked, baseline),
            note=untested_note("vLLM", checked_release, tested),
        )
    )
    engine.sections += format_sections(VLLM_FORMATS, checked, baseline)
    title = f"stats objects the stat-logger plugin and the hook read ({STATS_MODULE})"
    engine.sections.append(Section(title, "formats", compare_stats(checked, baseline)))
    engine.sections.append(
        Section(
            "/metrics families the daemon's scraper reads (crates/daemon/src/wire/vllm_metrics)",
            "families",
            check_families(scraped_families(), checked),
        )
    )
    engine.tests = run_vllm_tests(checked, dpcoord_binary())
    return engine


def check_sglang(checked_release: str) -> Engine:
    """SGLang ``checked_release`` against the newest release its route hook is
    tested with (without the hook: the one the compat suite installs)."""
    tables = hook_tables("dpcoord.sglang_route")
    tested = newest(tables[1]) if tables is not None else pinned("sglang")
    engine = Engine("SGLang", "sglang", checked_release, tested)
    checked = install("sglang", checked_release)
    baseline = release_folder("sglang", tested)
    if tables is None:
        note = "not checked: dpcoord has no SGLang route hook (dpcoord.sglang_route)"
        engine.sections.append(Section("the route hook's seams", "seams", note=note))
    else:
        seams, fingerprints = tables
        engine.sections.append(
            Section(
                f"the route hook's seams (dpcoord.sglang_route), fingerprints of {tested}",
                "seams",
                compare_seams("sglang", seams, fingerprints[tested], checked, baseline),
                note=untested_note("SGLang", checked_release, fingerprints),
            )
        )
    engine.sections += format_sections(SGLANG_FORMATS, checked, baseline)
    engine.tests = TestRun("not run", summary="the compat suite runs on the virtualenv's SGLang only")
    return engine


def report(engines: list[Engine]) -> list[str]:
    """The report's lines: each engine's sections, then the summary."""
    out: list[str] = []
    for e in engines:
        out.append(f"== {e.name} {e.checked} ({e.chosen}) against {e.tested}, the newest release dpcoord is tested with")
        for s in e.sections:
            out.append(f"-- {s.title}")
            if s.note:
                out.append(f"   {s.note}")
            width = max((len(f.name) for f in s.findings), default=0)
            for f in s.findings:
                out.append(f"{f.status:<10} {f.name:<{width}}  {f.detail}".rstrip())
                out.extend(f"    {line}" for line in f.diff)
        out.append(f"-- the compat suite's vLLM tests on {e.name} {e.checked}" if e.package == "vllm" else "-- the compat suite")
        out.append(f"{e.tests.status:<10} {e.tests.summary}".rstrip())
        out.extend(f"    {line}" for line in e.tests.failures)
        out.extend(f"    passed when run again (flaky): {test}" for test in e.tests.flaky)
        if e.tests.log is not None:
            out.append(f"    log: {e.tests.log}")
        out.append("")
    out.append("== summary")
    for e in engines:
        seams = f"seams {e.count('seams', 'unchanged')} unchanged, {e.count('seams', 'changed')} changed"
        if not any(s.findings for s in e.sections if s.kind == "seams"):
            seams = "seams not checked"
        label = "newest" if e.chosen == "the newest on PyPI" else "checked"
        line = (
            f"{e.name:<7} {label:<7} {e.checked:<8} tested {e.tested:<8} {seams}; "
            f"formats {e.count('formats', 'unchanged')} unchanged, {e.count('formats', 'changed')} changed"
        )
        if any(s.kind == "families" for s in e.sections):
            line += f"; /metrics families {e.count('families', 'present')} present, {e.count('families', 'missing')} missing"
        out.append(f"{line}; tests {e.tests.brief()}")
    drifted = [e.name for e in engines if e.drifted]
    out.append(f"drift: {', '.join(drifted)} (exit 1)" if drifted else "no drift (exit 0)")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", metavar="VERSION", help="check this vLLM release (default: the newest on PyPI)")
    parser.add_argument("--sglang", metavar="VERSION", help="check this SGLang release (default: the newest on PyPI)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "clients" / "python"))
    try:
        vllm_release = args.vllm or newest_on_pypi("vllm")
        sglang_release = args.sglang or newest_on_pypi("sglang")
        sglang = check_sglang(sglang_release)
        vllm = check_vllm(vllm_release)
        vllm.chosen = "--vllm" if args.vllm else vllm.chosen
        sglang.chosen = "--sglang" if args.sglang else sglang.chosen
    except CheckError as e:
        print(f"engines-drift: error: {e}", file=sys.stderr)
        return 2
    except Exception:  # noqa: BLE001 - any other failure of the check is its own error too
        import traceback

        traceback.print_exc()
        print("engines-drift: error: the check failed (above)", file=sys.stderr)
        return 2
    lines = report([vllm, sglang])
    print("\n".join(lines))
    return 1 if vllm.drifted or sglang.drifted else 0


if __name__ == "__main__":
    sys.exit(main())
