"""The layout of the house: runtime code (attn, specdec, graphs) never imports the development
tools (devtools: the fake Blackwell device patches torch), unittest.mock or the tests, and every
backend the registry names has the whole protocol of attn.base.AttentionBackend."""

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]

# Run in a fresh interpreter: imports every runtime module, prints what it should not have imported.
_IMPORT_EVERYTHING = r"""
import importlib, pathlib, pkgutil, sys
repo = pathlib.Path(sys.argv[1])
import torch, unittest  # torch._guards imports unittest.mock itself: forget it, so a later import shows
sys.modules.pop("unittest.mock", None)
vars(unittest).pop("mock", None)
names = []
for package in ("attn", "specdec", "graphs"):
    names.append(package)
    for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
        importlib.import_module(info.name)
        names.append(info.name)
tests = repo / "tests"
bad = [n for n, m in sys.modules.items() if n == "unittest.mock" or n.split(".")[0] in ("devtools", "tests")
       or tests in pathlib.Path(getattr(m, "__file__", None) or "/").resolve().parents]
print(len(names), " ".join(names))
print("BAD", " ".join(sorted(bad)))
"""


def test_runtime_modules_import_neither_devtools_nor_mock_nor_tests():
    run = subprocess.run([sys.executable, "-c", _IMPORT_EVERYTHING, str(REPO)], cwd=REPO, capture_output=True,
                         text=True, check=True)
    counted, bad = run.stdout.strip().splitlines()[-2:]
    imported = counted.split()[1:]
    # The walk found the whole tree (backends, Blackwell device facts, kernels), not just the tops.
    assert {"attn.backends.blackwell.device", "attn.kernels.triton_mla.wgmma", "attn.values", "specdec.worker",
            "graphs.runner"} <= set(imported)
    assert bad == "BAD", f"runtime imports pulled in: {bad.split()[1:]}"


def test_every_backend_has_the_whole_protocol():
    from attn.base import AttentionBackend
    from attn.registry import backend_names, get_backend_class

    members = set(AttentionBackend.__annotations__)
    members |= {name for name, value in vars(AttentionBackend).items()
                if not name.startswith("_") and (callable(value) or isinstance(value, classmethod))}
    assert {"page_sizes", "kv_dtypes", "compiles_per_q_len", "kv_len_bounds", "runs_on", "forward"} <= members
    for name in backend_names():
        cls = get_backend_class(name)
        missing = sorted(m for m in members if not hasattr(cls, m))
        assert not missing, f"{name} lacks {missing}"


def test_pyproject_lists_every_package():
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(REPO).parts) for top in ("attn", "specdec", "graphs", "devtools")
             for init in (REPO / top).rglob("__init__.py")}
    assert listed == found
