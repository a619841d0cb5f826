"""`ray start --head` on loopback, `ray job submit` the train job with token auth, check its summary.

The head runs with ``--block`` in its own process group, so the test stops exactly
the head it started (``ray stop`` would also kill the session's shared cluster).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _free_ports(n: int) -> list[int]:
    """n distinct free ports: every socket stays bound until all are chosen (a port released
    at once can be handed out again, which once gave the dashboard and its agent one port)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        ports = [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
    assert len(set(ports)) == n
    return ports


def _wait_dashboard(port: int, env: dict, head, log: Path, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert head.poll() is None, f"ray start exited: {log.read_text()[-3000:]}"
        r = subprocess.run([str(BIN / "ray"), "job", "list", "--address", f"http://127.0.0.1:{port}"],
                           env=env, capture_output=True, text=True)
        if r.returncode == 0:
            return
        time.sleep(2)
    raise TimeoutError(f"job server on {port} did not come up: {r.stderr[-2000:]}")


@pytest.mark.slow
def test_ray_start_then_job_submit_with_token_auth(tmp_path, small_parquet_dataset):
    token = secrets.token_hex(32)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") or k.startswith("RAY_TRAIN_")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, PATH=f"{BIN}:{env.get('PATH', '')}")
    gcs, dash, agent_http, agent_grpc, runtime_env, metrics, client = _free_ports(7)
    # a short temp dir: Ray's unix sockets live under it and must stay under ~107 characters
    ray_tmp = tempfile.mkdtemp(prefix="rmb", dir="/tmp")
    head_log = open(tmp_path / "head.log", "w")
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
         f"--port={gcs}", "--dashboard-host", "127.0.0.1", f"--dashboard-port={dash}", "--num-cpus", "4",
         "--include-dashboard", "true", "--temp-dir", ray_tmp, "--disable-usage-stats",
         # every fixed default port moved: the session's shared cluster may hold the defaults,
         # and a dashboard agent that cannot bind leaves the job server with no agent
         f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
         f"--runtime-env-agent-port={runtime_env}", f"--metrics-export-port={metrics}",
         f"--ray-client-server-port={client}"],
        env=env, stdout=head_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_dashboard(dash, env, head, tmp_path / "head.log")
        # without the token the job server refuses
        bad = dict(env, RAY_AUTH_TOKEN="0" * 64)
        denied = subprocess.run([str(BIN / "ray"), "job", "list", "--address", f"http://127.0.0.1:{dash}"],
                                env=bad, capture_output=True, text=True)
        assert denied.returncode != 0
        out = tmp_path / "run"
        cmd = [str(BIN / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{dash}", "--working-dir",
               str(ROOT), "--", "python", "jobs/train.py", "--data", str(small_parquet_dataset),
               "--output-dir", str(out), "--max-steps", "3", "--max-tokens", "2048", "--report-every", "1",
               "--checkpoint-every", "0", "--window", "64"]
        for _ in range(20):  # the job agent comes up a little after the job server
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)
            if r.returncode == 0 or "No available agent" not in r.stderr:
                break
            time.sleep(3)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["steps"] == 3
        assert summary["samples"] > 0 and summary["real_tokens"] > 0
        assert 0 < summary["fill"] <= 1.0
        assert summary["initial_loss"] > 0 and summary["final_loss"] > 0
    finally:
        try:
            os.killpg(head.pid, signal.SIGTERM)
            head.wait(timeout=60)
        except ProcessLookupError:  # the head already exited (its failure is reported above)
            pass
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        head_log.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)
