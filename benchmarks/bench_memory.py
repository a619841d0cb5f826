"""Memory you can plan: (a) the loss's peak before and after the chunked LM head; (b) `ray-mmbatch plan`'s
estimate against the measured peak.

(a) Loss + backward on a 151,936-row LM head (Qwen's vocabulary; hidden --hidden, default 64) at --targets
target tokens: the unchunked formula (``F.cross_entropy(head(h).float(), y)``, the loss before issue 43) and
``models.loss.target_cross_entropy`` (chunks of LOSS_CHUNK_TOKENS). Each case runs in a fresh subprocess whose
address space is capped at --limit-gb (RLIMIT_AS): a case that needs more stops with an allocation error and is
recorded as "over N GB" instead of pushing a shared machine into the OOM killer. Peak = growth of the process's
peak RSS (VmHWM, reset through /proc/self/clear_refs) over the loss + backward, glibc's mmap threshold pinned at
64 KiB so RSS follows the live tensors (train/peak.py, the helpers --measure uses).

(b) The tiny random Qwen2-VL of the tests (tests/hf_checkpoints.py), fp32 on CPU, at --budgets tokens: the
estimate (train/memory.estimate, as `ray-mmbatch plan` prints it) against ``train/peak.measure_peak`` (two real
optimizer steps of train/step.py on a synthetic all-target pack), each measure in a fresh subprocess. The
target is within 15 %.

    python benchmarks/bench_memory.py [--targets 4096 8192 16384] [--budgets 2048 4096 8192] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VOCAB = 151_936

LOSS_CASE = """
import json, resource, sys, time
limit, vocab = int(float(sys.argv[4]) * 2**30), int(sys.argv[5])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
import torch, torch.nn.functional as F
from ray_mmbatch.models.loss import target_cross_entropy
from ray_mmbatch.train import peak
targets, hidden, chunked = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "chunked"
peak.malloc_returns_memory()
torch.manual_seed(0)
head = torch.nn.Linear(hidden, vocab, bias=False)
h = torch.randn(1, targets, hidden, requires_grad=True)
y = torch.randint(0, vocab, (1, targets))
def unchunked(head, h, y):
    return F.cross_entropy(head(h[y != -100]).float(), y[y != -100].long(), reduction="sum")
loss_fn = (lambda: target_cross_entropy(head, h, y, "sum")) if chunked else (lambda: unchunked(head, h, y))
with torch.no_grad():  # warm-up: one-time costs (thread pools, kernels' buffers) outside the measure
    target_cross_entropy(head, h[:, :64], y[:, :64], "sum")
start = time.perf_counter()
try:
    with peak.RssPeak() as rss:
        loss_fn().backward()
    out = {"peak_bytes": rss.growth, "time_s": time.perf_counter() - start, "ok": True}
except (RuntimeError, MemoryError) as e:
    out = {"ok": False, "error": str(e).splitlines()[0][:160], "time_s": time.perf_counter() - start}
print(json.dumps(out))
"""

MEASURE_CASE = """
import json, sys
from ray_mmbatch.config import Config
from ray_mmbatch.train.peak import measure_peak
cfg = Config()
cfg.model.path, cfg.train.precision, cfg.budget.max_tokens = sys.argv[1], "fp32", int(sys.argv[2])
print(json.dumps(measure_peak(cfg)))
"""


def _run(code: str, *args, timeout: int = 1800) -> dict:
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"ok": False, "error": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"}
    return json.loads(lines[-1])


def loss_peaks(targets: list[int], hidden: int, limit_gb: float) -> list[dict]:
    rows = []
    for n in targets:
        for kind in ("unchunked", "chunked"):
            r = _run(LOSS_CASE, n, hidden, kind, limit_gb, VOCAB)
            rows.append({"targets": n, "loss": kind, **r})
            got = f"{r['peak_bytes'] / 2**30:.2f} GiB in {r['time_s']:.1f} s" if r.get("ok") else \
                f"over {limit_gb:g} GB: {r.get('error')}"
            print(f"(a) {n:>6,} targets  {kind:<9}  {got}", flush=True)
    return rows


def estimate_vs_measured(budgets: list[int]) -> list[dict]:
    from ray_mmbatch.config import Config
    from ray_mmbatch.train import memory as M
    from tests.hf_checkpoints import make_qwen_checkpoint

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        ck = str(make_qwen_checkpoint(Path(tmp) / "qwen2_vl", "qwen2_vl"))
        cfg = Config()
        cfg.model.path, cfg.train.precision = ck, "fp32"
        spec = M.model_spec(cfg)
        for tokens in budgets:
            cfg.budget.max_tokens = tokens
            items = M.estimate(spec, M.settings_from(cfg, cuda=False))
            est = M.total(items)
            r = _run(MEASURE_CASE, ck, tokens)
            err = (est - r["peak_bytes"]) / r["peak_bytes"]
            rows.append({"tokens": tokens, "estimate_bytes": est, "measured_bytes": r["peak_bytes"], "error": err,
                         "items": {i.name: i.bytes for i in items}, "method": r.get("method")})
            print(f"(b) {tokens:>6,} tokens  estimate {est / 2**20:7.1f} MiB  measured {r['peak_bytes'] / 2**20:7.1f}"
                  f" MiB  {err:+.1%}", flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", type=int, nargs="*", default=[4096, 8192, 16384])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--limit-gb", type=float, default=12.0, help="address-space cap of each loss case")
    p.add_argument("--budgets", type=int, nargs="*", default=[2048, 4096, 8192])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    start = time.time()
    out = {"loss": loss_peaks(args.targets, args.hidden, args.limit_gb) if args.targets else [],
           "estimate": estimate_vs_measured(args.budgets) if args.budgets else [],
           "hidden": args.hidden, "vocab": VOCAB, "limit_gb": args.limit_gb, "wall_s": time.time() - start}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    worst = max((abs(r["error"]) for r in out["estimate"]), default=0.0)
    print(f"estimate vs measured: worst {worst:.1%} (target 15 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
