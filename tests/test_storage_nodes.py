"""Nothing stays behind on a node: on a cluster of more than one node, a run whose checkpoints would
land on one node's disk (no --storage, or a local folder) is refused at start, naming the fix; a
bucket or a shared filesystem passes. The cluster is a real 2-node Ray cluster on this machine
(ray.cluster_utils.Cluster, in a child process so the session's shared cluster is untouched)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ray_mmbatch.run import cluster

CHILD = Path(__file__).parent / "multinode" / "storage_refused.py"


@pytest.mark.ray
def test_a_run_whose_checkpoints_stay_on_one_node_is_refused_at_start_on_two_nodes(tmp_path):
    proc = subprocess.run([sys.executable, str(CHILD), str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).parents[1])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["nodes"] == 2 and out["bucket"] == "ok"
    for name in ("default", "local"):
        msg, seconds = out[name]
        assert "this Ray cluster has 2 nodes" in msg and "--storage" in msg and "s3://" in msg, msg
        assert "\n" not in msg and seconds < 10  # at start: nothing read, no worker started
    assert "no --storage" in out["default"][0] and str(tmp_path / "run" / "ray_storage") in out["default"][0]
    assert out["local"][0].startswith(f"this Ray cluster has 2 nodes and --storage {tmp_path / 'run' / 'ckpts'}")
    assert "ray_storage" not in out["written"] and "ckpts" not in out["written"], out["written"]


def test_what_counts_as_reaching_every_node(tmp_path, monkeypatch):
    monkeypatch.delenv(cluster.SHARED_ENV, raising=False)
    where = str(tmp_path / "run" / "ray_storage")
    cluster.check_shared_storage("", where, 1)  # one node: its own disk is every node's
    with pytest.raises(cluster.ClusterError, match="3 nodes"):
        cluster.check_shared_storage("", where, 3)
    cluster.check_shared_storage("s3://b/runs", "s3://b/runs", 3)
    assert cluster.storage_is_shared("s3://b/runs") and cluster.storage_is_shared("gs://b/runs")
    if cluster.mount_type(str(tmp_path)) not in cluster.NETWORK_FS:
        assert not cluster.storage_is_shared(str(tmp_path / "ckpts"))
    monkeypatch.setenv(cluster.SHARED_ENV, "1")  # a filesystem the list does not know, declared shared
    assert cluster.storage_is_shared(str(tmp_path / "ckpts"))
    cluster.check_shared_storage("", where, 3)
    assert cluster.mount_type("/proc/self") == "proc"  # the nearest mount of the path, by /proc/mounts
