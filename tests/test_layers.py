"""The packages form layers that import one way (docs/architecture.md): a package imports
only packages below it, function-local imports included, and each package imports on its
own, loading nothing above it."""

import ast
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

import minihf

SRC = Path(minihf.__file__).parent
ROOT = Path(__file__).resolve().parents[1]

# bottom up; a package may import any package on an earlier line, and none on a later one.
# Packages on one line do not import each other. The root package (``minihf``: the version
# and lazy entry points) may be imported from anywhere.
LAYERS = [
    ["utils"],
    ["protocol"],
    ["config"],
    ["controller"],
    ["testing"],
    ["models"],
    ["parallel"],
    ["rollout"],
    ["multi_turn"],
    ["hybrid"],
    ["algorithms"],
    ["data"],
    ["hub"],
    ["workers"],
    ["roles"],
    ["planner"],
    ["trainer"],
    ["api", "launcher"],
    ["cli"],
]
LEVEL = {pkg: i for i, line in enumerate(LAYERS) for pkg in line}
# extras (pyproject.toml) and what only a benchmark uses: imported by the feature that needs them.
# Not flash_attn: models/masks.py imports it at the top when installed, on purpose (the GPU
# attention path is chosen once, at import).
OPTIONAL = ["wandb", "tensorboard", "matplotlib", "gguf", "accelerate", "trl", "datasets"]


def _sources() -> list[Path]:
    """minihf's modules; the recipes shipped as data (``minihf/recipes``, recipe files
    imported by path, above every layer) are not part of the package's layers."""
    return sorted(p for p in SRC.rglob("*.py") if "recipes" not in p.relative_to(SRC).parts[:1])


def _module_name(path: Path, src: Path = SRC) -> str:
    parts = path.relative_to(src.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "minihf"


def _imports(path: Path, src: Path = SRC):
    """``(line, imported module)`` of every import in the file, at any depth; ``from minihf
    import launcher`` counts as importing ``minihf.launcher``."""
    name, is_init = _module_name(path, src), path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the file's own package
                base = name.split(".") if is_init else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + [node.module] if node.module else base)
            else:
                module = node.module
            if module == "minihf":  # names imported from the root: packages or the root's own
                yield from ((node.lineno, f"minihf.{a.name}" if a.name in LEVEL else "minihf") for a in node.names)
            else:
                yield node.lineno, module


def _upward_edges(files, src: Path = SRC) -> list[str]:
    bad = []
    for path in files:
        own = _package(_module_name(path, src))
        if own == "minihf":
            continue  # the root's lazy ``minihf.train`` & co. import the entry points when called
        for line, target in _imports(path, src):
            if not target.startswith("minihf"):
                continue
            other = _package(target)
            if other == own or other == "minihf":
                continue
            if LEVEL[other] >= LEVEL[own]:
                bad.append(f"{path.relative_to(src.parent)}:{line} ({own}) imports {target} ({other})")
    return bad


def test_every_package_has_a_layer():
    found = {_package(_module_name(p)) for p in _sources()} - {"minihf"}
    assert found == set(LEVEL), f"add {sorted(found - set(LEVEL))} to LAYERS (and to docs/architecture.md)"


def test_no_import_runs_up():
    assert _upward_edges(_sources()) == []


def test_the_check_finds_an_upward_import(tmp_path):
    """The check itself, on a models file (in a copy of the layout) that imports upper
    layers in a function body: absolute, relative, and a package named from the root."""
    src = tmp_path / "minihf"
    bad = src / "models" / "_layer_probe.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("def f():\n    from minihf.data import load_tokenizer\n    from ..hub import init_model\n"
                   "    from minihf import launcher, __version__\n    from minihf.utils import files\n")
    assert _upward_edges([bad], src) == [
        "minihf/models/_layer_probe.py:2 (models) imports minihf.data (data)",
        "minihf/models/_layer_probe.py:3 (models) imports minihf.hub (hub)",
        "minihf/models/_layer_probe.py:4 (models) imports minihf.launcher (launcher)"]


def test_docs_list_the_layers_in_order():
    table = (ROOT / "docs" / "architecture.md").read_text().split("## The layers", 1)[1].split("\n## ", 1)[0]
    rows = [re.findall(r"`minihf\.(\w+)`", cell) for cell in re.findall(r"^\| ([^|]+) \|", table, flags=re.M)]
    assert [sorted(r) for r in rows if r] == [sorted(line) for line in LAYERS]


_ISOLATION = r"""
import os, pickle, pkgutil, sys
import importlib
levels = pickle.loads(bytes.fromhex(sys.argv[1]))
OPTIONAL = pickle.loads(bytes.fromhex(sys.argv[2]))


def import_all(pkg):
    mod = importlib.import_module("minihf." + pkg)
    names = [m.name for m in pkgutil.walk_packages(getattr(mod, "__path__", []), mod.__name__ + ".")]
    for name in names:
        if not name.endswith("__main__"):
            importlib.import_module(name)


def in_child(fn):  # fn()'s result, computed in a forked child (what it imports stays there)
    r, w = os.pipe()
    if (pid := os.fork()) == 0:
        os.close(r)
        try:
            os.write(w, pickle.dumps(fn()))
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.waitpid(pid, 0)
    return pickle.loads(data)


def third_party_of_all():
    for pkg in levels:
        try:
            import_all(pkg)
        except BaseException:
            pass  # its own child below reports it
    return sorted(m for m in sys.modules if m.split(".")[0] != "minihf")


def alone(pkg):
    try:
        import_all(pkg)
        return "ok", sorted({m.split(".")[1] for m in sys.modules if m.startswith("minihf.")})
    except BaseException as e:
        return "error", f"{type(e).__name__}: {e}"


# the third-party modules minihf uses (torch, transformers, ...) are imported once, here,
# before the forks; they are learnt from a first child that imports all of minihf
third_party = in_child(third_party_of_all)
out = {"optional packages": sorted({m.split(".")[0] for m in third_party} & set(OPTIONAL))}
for name in third_party:
    try:
        importlib.import_module(name)
    except BaseException:
        pass
for pkg in levels:
    out[pkg] = in_child(lambda: alone(pkg))
print(pickle.dumps(out).hex())
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="uses fork to import each package in a fresh child")
def test_each_package_imports_alone():
    """Each package, with all its modules, imports in a process where no other minihf
    package was imported first, and what that loads lies at or below its layer; importing
    all of minihf imports none of the optional packages."""
    proc = subprocess.run([sys.executable, "-c", _ISOLATION, pickle.dumps(list(LEVEL)).hex(),
                           pickle.dumps(OPTIONAL).hex()],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = pickle.loads(bytes.fromhex(proc.stdout.strip().splitlines()[-1]))
    optional = results.pop("optional packages")
    problems = [f"importing minihf imports the optional {p}: import it where it is used" for p in optional]
    for pkg, (status, value) in results.items():
        if status != "ok":
            problems.append(f"minihf.{pkg} does not import alone: {value}")
            continue
        above = [p for p in value if LEVEL[p] > LEVEL[pkg]]
        if above:
            problems.append(f"importing minihf.{pkg} loads {above}, above it")
    assert problems == []
