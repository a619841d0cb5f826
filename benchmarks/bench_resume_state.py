"""Resume state at scale: size, checkpoint write time and resume-filter time (data/position.py).

A simulated epoch of ``--samples`` samples in ``--units`` read units (rows spread evenly),
stopped mid-epoch: the first half of the units (in a seeded order, as an epoch > 0 reads
them) finished, ``--in-flight`` units partly trained (random rows, as ranks and windows
interleave them), the rest not started. Reported:

  state      the checkpoint's data position as JSON (what state.json and
             latest_checkpoint.json hold), bytes
  write      DataPosition.state_dict + json.dumps + checkpoint.write_state (atomic, fsync)
  resume     what a restarted dataset builder does: json load + DataPosition.from_state,
             then per unit the reader's decision (read_with_position: skip finished units,
             drop the done rows of units in flight with an Arrow filter, pass the rest)
  report     one report's delta: the positions trained since the last report
             (``--report-samples``), all-gathered as int64 (8 bytes + unit rows 8 bytes each),
             and the time to apply it (DataPosition.add)

The units in flight follow the epoch's shuffle (batching/shuffle.py): with the seeded
swap buffer of ``--buffer`` rows (the default data.shuffle_buffer) a unit is in flight
from its first row out of the buffer to its last, so their number is measured by pushing
a stream of units through the real ShuffleBuffer and counting, at the stop, the units with
rows both out and still held (plus the unit being read, plus ``--window`` rows planned
ahead). ``--in-flight N`` sets the count instead.

    python benchmarks/bench_resume_state.py [--samples 100000000] [--units 50000]
        [--buffer 16384] [--in-flight N] [--report-samples 4096]
"""
from __future__ import annotations

import argparse
import json
import pickle
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ray_mmbatch.data.position import DataPosition, encode_positions
from ray_mmbatch.train.checkpoint import write_state


def simulate(samples: int, units: int, in_flight: int, seed: int = 0) -> tuple[DataPosition, np.ndarray, int]:
    """(position stopped mid-epoch, unit order, rows per unit)."""
    rows = samples // units
    rng = np.random.default_rng(seed)
    order = rng.permutation(units)
    dp = DataPosition()
    ep = dp.epoch(0)
    done = order[: units // 2]
    # finished units: marked as the train loop marks them (every row added; bulk here for speed)
    ep.finished = np.zeros(units, dtype=bool)
    ep.finished[done] = True
    for u in order[units // 2: units // 2 + in_flight].tolist():
        r = rng.choice(rows, size=int(rng.integers(1, rows)), replace=False)
        ep.add(encode_positions(np.full(len(r), u), r), np.full(len(r), rows))
    return dp, order, rows


def units_in_flight(rows: int, buffer: int, window: int = 2048, seed: int = 0) -> int:
    """Units partly trained at a stop mid-epoch under the shuffle buffer (see the module header)."""
    from ray_mmbatch.batching.shuffle import ShuffleBuffer

    units = max(8, 3 * (buffer + window) // rows + 8) * 4  # enough stream for the buffer to be in steady state
    stream = np.repeat(np.arange(units), rows).tolist()
    positions = (np.arange(len(stream)) + 1).tolist()
    b = ShuffleBuffer(buffer, seed, 0)
    out, held = b.push(stream, positions), b.items
    trained, planned = set(out[:len(out) - window]), set(out[len(out) - window:])  # window rows planned ahead
    return len((trained & (set(held) | planned)) | {stream[-1]})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=100_000_000)
    ap.add_argument("--units", type=int, default=50_000)
    ap.add_argument("--buffer", type=int, default=None, help="shuffle buffer rows (default: data.shuffle_buffer)")
    ap.add_argument("--in-flight", type=int, default=None, help="units in flight (default: measured for --buffer)")
    ap.add_argument("--report-samples", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)

    if args.buffer is None:
        from ray_mmbatch.config import DataConfig

        args.buffer = DataConfig().shuffle_buffer
    if args.in_flight is None:
        args.in_flight = units_in_flight(args.samples // args.units, args.buffer)
    dp, order, rows = simulate(args.samples, args.units, args.in_flight)
    # a block of one unit as the reader has it before the filter (ids and positions only:
    # filtering image bytes costs the same per kept byte with or without this state)
    block = pa.table({"sample_id": pa.array([f"s{i}" for i in range(rows)]),
                      "unit_row": pa.array(np.arange(rows, dtype=np.int64))})
    best = {"write": float("inf"), "resume": float("inf"), "apply": float("inf")}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            state = {"step": 1, "position": dp.state_dict()}
            write_state(tmp, state)
            best["write"] = min(best["write"], time.perf_counter() - t0)
            size = (Path(tmp) / "state.json").stat().st_size

            t0 = time.perf_counter()
            loaded = DataPosition.from_state(json.loads((Path(tmp) / "state.json").read_text())["position"])
            done = loaded.epochs[0]
            kept = 0
            for u in order.tolist():
                if done.unit_finished(u):
                    continue
                keep = done.rows_to_read(u, rows)
                kept += rows if keep is None else block.filter(pa.array(keep)).num_rows
            best["resume"] = min(best["resume"], time.perf_counter() - t0)
    trained = args.samples // 2 + sum(int(b.sum()) for b in dp.epochs[0].in_flight.values())
    assert kept == args.samples - trained, (kept, args.samples - trained)

    # one report's delta: the next report_samples rows of the stream, from units in flight
    u = order[args.units // 2 + args.in_flight:]
    flat = np.repeat(u, rows)[: args.report_samples]
    delta = (0, encode_positions(flat, np.arange(len(flat)) % rows), np.full(len(flat), rows))
    wire = len(pickle.dumps([delta]))
    for _ in range(args.repeat):
        copy = DataPosition.from_state(dp.state_dict())
        t0 = time.perf_counter()
        copy.add(*delta)
        best["apply"] = min(best["apply"], time.perf_counter() - t0)

    print(f"simulated epoch: {args.samples:,} samples in {args.units:,} units of {rows} rows, stopped mid-epoch "
          f"({args.units // 2:,} units finished, {args.in_flight} in flight under a shuffle buffer of "
          f"{args.buffer:,} rows, {trained:,} samples trained)")
    print(f"  state.json            {size / 1024:10.1f} kB")
    print(f"  checkpoint write      {best['write'] * 1e3:10.1f} ms   (state_dict + JSON + atomic write, best of "
          f"{args.repeat})")
    print(f"  resume filter         {best['resume'] * 1e3:10.1f} ms   (load + per-unit decisions + Arrow filter of "
          f"units in flight; {kept:,} samples left to read)")
    print(f"  report delta          {wire / 1024:10.1f} kB   for {args.report_samples} samples, applied in "
          f"{best['apply'] * 1e3:.2f} ms")
    old = args.samples // 2 * (len('"e0:file-00000.parquet:000000000",'))
    print(f"  (per-sample id list it replaces: ~{old / 2**20:,.0f} MB at this point of the epoch)")


if __name__ == "__main__":
    main()
