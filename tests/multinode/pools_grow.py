"""Child process of tests/test_multinode.py: a 3-node Ray cluster on this machine
(head with no CPU slots, a data node offering 'preprocess', a train node), one epoch of
the data path pinned to the data node; prints one JSON line of what it saw."""
from __future__ import annotations

import json
import sys
import threading
import time


def main(data: str, data_cpus: int) -> None:
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.state import list_actors

    from ray_mmbatch import schema as S
    from ray_mmbatch.config import Config
    from ray_mmbatch.dataflow.pipeline import batch_dataset, pools_for, set_deterministic
    from ray_mmbatch.dataflow.pools import ResourceError
    from ray_mmbatch.train.trainer import tokenizer_ids

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    data_node = cluster.add_node(num_cpus=data_cpus, resources={"preprocess": data_cpus})
    cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars, ctx.print_on_execution_start = False, False
    out: dict = {}
    try:
        cfg = Config()
        cfg.data.path, cfg.data.data_resource = data, "preprocess"
        cfg.budget.window = 64
        cfg.train.num_workers = 2
        sizes = pools_for(cfg)
        out["sizes"] = {"measure": sizes.measure, "materialize": sizes.materialize, "slots": sizes.slots}
        peak = {"materialize": 0, "measure": 0, "off_data_node": 0}
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                try:  # the state API can time out on a loaded machine: skip that poll, keep watching
                    alive = [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
                             if a.class_name.startswith("MapWorker(")]
                except Exception:
                    time.sleep(0.5)
                    continue
                peak["materialize"] = max(peak["materialize"], sum("MaterializeStage" in a.class_name for a in alive))
                peak["measure"] = max(peak["measure"], sum("MeasureStage" in a.class_name for a in alive))
                peak["off_data_node"] += sum(a.node_id != data_node.node_id for a in alive)
                time.sleep(0.5)

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        set_deterministic(True)
        t0 = time.perf_counter()
        ids = [s for r in batch_dataset(cfg, tokenizer_ids(cfg)["pad_id"]).iter_rows()
               for s in r[S.BATCH_SAMPLE_IDS]]
        out["wall_s"] = time.perf_counter() - t0
        stop.set()
        t.join()
        out.update(peak=peak, samples=len(ids), unique=len(set(ids)))
        cfg.data.preprocess_workers = data_cpus  # pinned pools larger than the data node: fail at once
        t0 = time.perf_counter()
        try:
            pools_for(cfg, check=True)
            out["pinned_error"] = ""
        except ResourceError as e:
            out["pinned_error"] = str(e)
        out["pinned_error_s"] = time.perf_counter() - t0
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
