"""The core imports no Ray (ARCHITECTURE.md), checked by walking whole packages, not a hand list.

Every package of ``ray_mmbatch`` is either pure (each of its modules, imported in a fresh
interpreter, leaves ``ray`` out of sys.modules; the data / batching / formats / synthetic layers
and the config leave ``torch`` out too) or the Ray shell (dataflow/, run/, train/, commands/).
A new package must say which it is (the first test fails until it does). The shell's in-process
path, ``local_batches``, runs on a real dataset without loading Ray."""
from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import ray_mmbatch

# pure packages / top-level modules -> may they import torch?
PURE = {"data": False, "batching": False, "formats": False, "synthetic": False, "config": False, "schema": False,
        "models": True, "hf": True}
SHELL = {"dataflow", "run", "train", "commands", "cli", "assets", "flagdoc"}  # flagdoc: renders the commands

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

LOCAL = """
import sys
from ray_mmbatch import local_batches
from ray_mmbatch.config import Config
cfg = Config()
cfg.data.path, cfg.data.format = sys.argv[1], "parquet"
cfg.budget.max_tokens, cfg.budget.window = 2048, 32
batches = list(local_batches(cfg))
assert sum(len(b["sample_ids"]) for b in batches) > 0
assert "ray" not in sys.modules, sorted(m for m in sys.modules if m.startswith("ray."))[:5]
print(len(batches))
"""


def test_every_package_is_pure_or_shell():
    root = Path(ray_mmbatch.__file__).parent
    found = {m.name for m in pkgutil.iter_modules([str(root)])}
    found |= {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("_")}
    assert found == set(PURE) | SHELL, f"say whether these are pure or shell: {found ^ (set(PURE) | SHELL)}"


def test_no_pure_module_imports_ray():
    for name, torch_ok in PURE.items():
        r = subprocess.run([sys.executable, "-c", CHECK, name, "1" if torch_ok else "0"], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, f"ray_mmbatch.{name}: {r.stderr[-1500:]}"


def test_local_batches_runs_without_ray(tmp_path):
    from ray_mmbatch.synthetic.generate import generate_dataset

    generate_dataset(str(tmp_path / "d"), 40, "parquet", seed=3, workers=1)
    r = subprocess.run([sys.executable, "-c", LOCAL, str(tmp_path / "d")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.strip().splitlines()[-1]) > 0
