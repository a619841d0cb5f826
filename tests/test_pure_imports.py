"""The core imports no Ray (ARCHITECTURE.md): every module of the pure packages, imported in a
fresh interpreter, leaves ``ray`` out of sys.modules; the data / batching / formats layers and
the config leave ``torch`` out too. A new module in these packages is covered by walking them."""
from __future__ import annotations

import subprocess
import sys

# package or module under ray_mmbatch -> may it import torch?
PURE = {"data": False, "batching": False, "formats": False, "config": False, "schema": False, "guards": False,
        "runlog": False, "synthetic": False, "end_of_stream": False, "models": True, "train.step": True, "verify": True}

CHECK = """
import importlib, pkgutil, sys
name, torch_ok = sys.argv[1], sys.argv[2] == "1"
mod = importlib.import_module("ray_mmbatch." + name)
names = [mod.__name__] + [i.name for i in pkgutil.walk_packages(getattr(mod, "__path__", []), mod.__name__ + ".")]
for n in names:
    importlib.import_module(n)
    assert "ray" not in sys.modules, n + " imports ray"
    assert torch_ok or "torch" not in sys.modules, n + " imports torch"
print(len(names))
"""


def test_no_pure_module_imports_ray():
    for name, torch_ok in PURE.items():
        r = subprocess.run([sys.executable, "-c", CHECK, name, "1" if torch_ok else "0"], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, f"ray_mmbatch.{name}: {r.stderr[-1500:]}"
