"""What the growing shuffle buffer (--shuffle-ramp) costs in mixing, at epochs smaller and larger
than the buffer, without Ray (the pure ShuffleBuffer over the seeded unit order, which is the
order the Ray path's plan actor sees in deterministic mode).

A dataset of SUBSETS sorted subsets of PER samples each, in read units of 50 rows (one subset
each); each seed draws the unit order (--shuffle units) and pushes the stream through a buffer
of 16,384 rows with ramp 0 (fill first), 0.1 (default) and 0.25. Reported per seed: rank
correlation with the listing and the worst of 20 parts' total-variation distance from the
whole subset mix (batching/mixing.py), and the same for a uniformly random permutation.

    python benchmarks/bench_ramp.py 16 400      # 6,400 samples: the buffer spans the epoch
    python benchmarks/bench_ramp.py 16 8000     # 128,000 samples: the epoch is 8x the buffer
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ray_mmbatch.batching.mixing import order_figures  # noqa: E402
from ray_mmbatch.batching.shuffle import ShuffleBuffer, unit_order  # noqa: E402


def main(subsets: int, per: int, rows: int = 50, buffer: int = 16384) -> None:
    n_units = subsets * per // rows
    sub = np.repeat(np.arange(subsets), per // rows)
    for seed in (0, 1, 2):
        order = unit_order(n_units, seed, 0, "units")
        stream = [u * 1000 + k for u in order for k in range(rows)]
        res = []
        for r in (0.0, 0.1, 0.25):
            b = ShuffleBuffer(buffer, seed, 0, ramp=r)
            pos = np.array(b.push(stream, stream) + b.flush())
            units = pos // 1000
            f = order_figures(np.argsort(np.argsort(units * rows + pos % 1000)), sub[units])
            res.append(f"ramp {r}: rho {f['rank_correlation']:+.3f} tv {f['worst_part_distance']:.3f}")
        perm = np.random.default_rng(seed).permutation(len(stream))
        f = order_figures(np.argsort(np.argsort(perm)), sub[np.array(stream)[perm] // 1000])
        print(f"{subsets} x {per} seed {seed} | " + " | ".join(res) + f" | random tv {f['worst_part_distance']:.3f}")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
