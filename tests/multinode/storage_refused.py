"""Child process of tests/test_storage_nodes.py: a 2-node Ray cluster on this machine (head with no CPU
slots, one worker node); a run whose checkpoints would stay on one node's disk is refused at start, and
one with a bucket for --storage passes the same check. Prints one JSON line of what it saw."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(out_dir: str) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from ray_mmbatch.config import Config
    from ray_mmbatch.run.cluster import ClusterError
    from ray_mmbatch.train.trainer import check_storage_reaches_nodes, run_training

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    out: dict = {"nodes": len([n for n in ray.nodes() if n["Alive"]])}
    try:
        cfg = Config()
        cfg.train.output_dir = out_dir
        for name, storage in (("default", ""), ("local", str(Path(out_dir) / "ckpts"))):
            cfg.train.storage = storage
            t0 = time.perf_counter()
            try:
                run_training(cfg)
                out[name] = ["trained", 0.0]
            except ClusterError as e:
                out[name] = [str(e), time.perf_counter() - t0]
        cfg.train.storage = "s3://a-bucket/runs"
        check_storage_reaches_nodes(cfg)  # raises if a bucket were refused
        out["bucket"] = "ok"
        out["written"] = sorted(p.name for p in Path(out_dir).iterdir()) if Path(out_dir).exists() else []
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
