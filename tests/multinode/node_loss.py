"""Child process of tests/test_multinode.py: train one epoch on a 3-node Ray cluster on this
machine (head without CPU slots, a data node offering 'preprocess', a 2-CPU train node), kill
the data node mid-epoch (every process on it, as a preempted VM; the Train worker may be placed
there too), then add a fresh one. Prints one JSON line: the ledger's trained ids and the
skipped ids, for the parent to check exactly-once.

    python tests/multinode/node_loss.py DATA OUT [samples|units|none]

Before the fix in train/checkpoint.read_latest_position (fallback=False for the stream), 289-294
of 300 samples were trained and none reported: the rebuilt stream left out the data position
rank 0 had written after a report that Ray had not registered when the node died."""
from __future__ import annotations

import csv
import json
import sys
import threading
import time
from pathlib import Path


def main(data: str, out_dir: str, shuffle: str = "samples") -> None:
    import ray
    from ray.cluster_utils import Cluster

    from ray_mmbatch import schema as S
    from ray_mmbatch.config import Config
    from ray_mmbatch.train.trainer import run_training

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    node = cluster.add_node(num_cpus=4, resources={"preprocess": 4})
    cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    out = Path(out_dir)
    cfg = Config()
    cfg.data.path, cfg.data.format, cfg.data.data_resource = data, "parquet", "preprocess"
    cfg.data.shuffle, cfg.data.shuffle_buffer = shuffle, 64  # batches flow before the epoch is measured
    cfg.budget.max_tokens, cfg.budget.window = 2048, 64
    cfg.train.output_dir, cfg.train.ledger = str(out), True
    cfg.train.report_every = cfg.train.checkpoint_every = 2
    cfg.train.max_steps, cfg.train.num_workers, cfg.train.max_failures = 0, 1, 4
    events: dict = {"removed_at_step": None}
    result: dict = {}

    def train() -> None:
        try:
            result["summary"] = run_training(cfg)
        except BaseException as e:  # reported by the main thread
            result["error"] = e

    t = threading.Thread(target=train, daemon=True)  # the main thread adds nodes (Ray needs it for signals)
    t.start()
    try:
        deadline = time.time() + 600
        while t.is_alive() and time.time() < deadline and events["removed_at_step"] is None:
            ledger = out / S.RUN_LEDGER
            steps = sum(len(p.read_text().splitlines()) for p in ledger.glob("rank*.jsonl")) if ledger.exists() else 0
            if steps >= 4:
                events["removed_at_step"] = steps
                cluster.remove_node(node)  # SIGKILL of everything on it
                time.sleep(3)
                cluster.add_node(num_cpus=4, resources={"preprocess": 4})
            time.sleep(0.2)
        t.join(900)
    finally:
        ray.shutdown()
        cluster.shutdown()
    if "error" in result:
        raise result["error"]
    summary = result["summary"]
    trained = [sid for p in sorted((out / S.RUN_LEDGER).glob("rank*.jsonl"))
               for ln in p.read_text().splitlines() for sid in json.loads(ln)["sample_ids"]]
    with open(out / S.RUN_SKIPPED) as f:
        skipped = [r["sample_id"] for r in csv.DictReader(f)]
    print("RESULT " + json.dumps({"trained": trained, "skipped": skipped, "steps": summary["steps"], **events}),
          flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
