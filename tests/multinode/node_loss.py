"""Child process of tests/test_multinode.py: train one epoch on a 3-node Ray cluster on this
machine (head without CPU slots, a data node offering 'preprocess', a 2-CPU train node), kill
one node mid-epoch (every process on it, as a preempted VM), then add a fresh one:

- ``data``: the data node (the Train worker may be placed there too);
- ``train``: the train node, which offers 'train' and holds the Train worker (--train-resource).

Prints one JSON line: the ledger's trained ids, the skipped ids and the progress lines the
driver showed, for the parent to check exactly-once. Every run file is written by the driver
from what the ranks sent through Ray (train/events.py); the child checks that no rank wrote one.

    python tests/multinode/node_loss.py DATA OUT [data|train|data,train] [samples|units|none]

``data,train``: both, one after the other on the same cluster (its start-up shared; the node killed first is
replaced before the second run starts), each run in OUT/<which>, one JSON line each.

Before the fix in train/checkpoint.read_latest_position (fallback=False for the stream), 289-294
of 300 samples were trained and none reported: the rebuilt stream left out the data position
rank 0 had written after a report that Ray had not registered when the node died."""
from __future__ import annotations

import csv
import json
import os
import sys
import threading
import time
from pathlib import Path

from ray_mmbatch.run.rundir import RunDir

NODES = {"data": {"num_cpus": 4, "resources": {"preprocess": 4}}, "train": {"num_cpus": 2, "resources": {"train": 1}}}


def main(data: str, out_dir: str, which: str = "data", shuffle: str = "samples") -> None:
    import ray
    from ray.cluster_utils import Cluster

    from ray_mmbatch.run.cluster import SHARED_ENV

    # A killed node is declared dead after health_check_failure_threshold failed checks health_check_period_ms
    # apart (Ray's defaults: 5 x 3 s); a killed raylet refuses at once, so 3 x 1 s finds it in ~3 s, while a
    # live one still has health_check_timeout_ms (10 s) to answer each check on this loaded machine
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "_system_config": {
        "health_check_period_ms": 1000, "health_check_failure_threshold": 3}})
    nodes = {name: cluster.add_node(**args) for name, args in NODES.items()}
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    os.environ[SHARED_ENV] = "1"  # these nodes share this machine's disk: its OUTPUT_DIR/ray_storage reaches all
    scenarios = which.split(",")
    try:
        for name in scenarios:
            out = Path(out_dir) / name if len(scenarios) > 1 else Path(out_dir)
            print("RESULT " + json.dumps({"which": name, **_preempted_run(cluster, nodes, data, out, name,
                                                                             shuffle)}), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()


def _preempted_run(cluster, nodes: dict, data: str, out: Path, which: str, shuffle: str) -> dict:
    """One epoch with the ``which`` node killed at step 4 and a fresh one added (``nodes[which]`` then)."""
    import io

    from ray_mmbatch.config import Config
    from ray_mmbatch.run.progress import ProgressPrinter
    from ray_mmbatch.train.trainer import run_training

    node = nodes[which]
    cfg = Config()
    cfg.data.path, cfg.data.format, cfg.data.data_resource = data, "parquet", "preprocess"
    cfg.data.shuffle, cfg.data.shuffle_buffer = shuffle, 64  # batches flow before the epoch is measured
    cfg.budget.max_tokens, cfg.budget.window = 2048, 64
    cfg.train.output_dir, cfg.train.ledger = str(out), True
    cfg.train.report_every = cfg.train.checkpoint_every = 2
    cfg.train.max_steps, cfg.train.num_workers, cfg.train.max_failures = 0, 1, 4
    cfg.train.worker_resource = "train" if which == "train" else ""
    console = io.StringIO()
    events: dict = {"removed_at_step": None}
    result: dict = {}

    def train() -> None:
        try:
            with ProgressPrinter(out / RunDir.METRICS, max_steps=0, stream=console, interval=0.2):
                result["summary"] = run_training(cfg)
        except BaseException as e:  # reported by the main thread
            result["error"] = e

    t = threading.Thread(target=train, daemon=True)  # the main thread adds nodes (Ray needs it for signals)
    t.start()
    deadline = time.time() + 600
    while t.is_alive() and time.time() < deadline and events["removed_at_step"] is None:
        ledger = out / RunDir.LEDGER
        steps = sum(len(p.read_text().splitlines()) for p in ledger.glob("rank*.jsonl")) if ledger.exists() else 0
        if steps >= 4:
            events["removed_at_step"] = steps
            cluster.remove_node(node)  # SIGKILL of everything on it
            time.sleep(3)
            nodes[which] = cluster.add_node(**NODES[which])
        time.sleep(0.2)
    t.join(900)
    if t.is_alive():
        raise TimeoutError(f"the {which} run did not end in 900 s")
    if "error" in result:
        raise result["error"]
    summary = result["summary"]
    trained = [sid for p in sorted((out / RunDir.LEDGER).glob("rank*.jsonl"))
               for ln in p.read_text().splitlines() for sid in json.loads(ln)["sample_ids"]]
    with open(out / RunDir.SKIPPED) as f:
        skipped = [r["sample_id"] for r in csv.DictReader(f)]
    rank_files = sorted(p.name for p in out.rglob("*rank*") if p.parent != out / RunDir.LEDGER)
    return {"trained": trained, "skipped": skipped, "steps": summary["steps"], **events,
            "summary_samples": summary["samples"], "rank_files": rank_files,
            "progress_lines": console.getvalue().splitlines()}


if __name__ == "__main__":
    main(*sys.argv[1:5])
