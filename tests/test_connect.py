"""The run goes where the user's Ray is: a `ray start --head` cluster that uses token auth (a token file
exists, as after an earlier local run) is joined from a shell without RAY_AUTH_MODE, at once, not
taken for a dead cluster; without a usable token, or at an address where nothing listens, the run
stops with the fix and starts no cluster of its own.

The head runs with its own HOME (the token) and RAY_TMPDIR (the address file `ray start` leaves), in
its own process group, which the test kills: `ray stop` would stop every Ray on the machine."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
RAY = Path(sys.executable).with_name("ray")

# one Python process for every case (a Ray import costs seconds on a loaded machine): the refusals
# first (none of them may start a cluster), then, as a fresh shell with the token file in its HOME and
# no RAY_ADDRESS, the join through the address file `ray start` left
CASES = """
import json, os, time, ray
from ray_mmbatch.run.cluster import ClusterError
from ray_mmbatch.train.trainer import connect
out = {}
for case, env in json.loads(os.environ.pop("CASES")).items():
    os.environ.update(env)
    t = time.time()
    try:
        connect()
        out[case] = ["joined", 0]
    except ClusterError as e:
        out[case] = [str(e), time.time() - t]
    for k in env:
        os.environ.pop(k)
out["initialized"] = ray.is_initialized()
os.environ["HOME"] = os.environ.pop("TOKEN_HOME")
connect()
out["join"] = {"gcs": ray.get_runtime_context().gcs_address, "auth": os.environ.get("RAY_AUTH_MODE"),
               "task": ray.get(ray.remote(lambda: 42).remote())}
print("RESULT " + json.dumps(out))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env.update(PYTHONPATH=str(REPO), **extra)
    return env


def _run(code: str, env: dict[str, str]) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def token_head():
    """(port, HOME with the token, RAY_TMPDIR) of a `ray start --head` using token auth."""
    root = Path(tempfile.mkdtemp(prefix="rmc", dir="/tmp"))  # short: Ray's socket paths live under it
    home, tmp = root / "home", root / "t"
    (home / ".ray").mkdir(parents=True)
    tmp.mkdir()
    (home / ".ray" / "auth_token").write_text("c0ffee" * 10)
    port = _free_port()
    # no RAY_AUTH_MODE: `ray start` turns token auth on because the token file exists
    head = subprocess.Popen([str(RAY), "start", "--head", f"--port={port}", "--num-cpus=1", "--block",
                             "--include-dashboard=false", "--disable-usage-stats"],
                            env=_env(HOME=str(home), RAY_TMPDIR=str(tmp)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 90
        while not (_listening(port) and list(tmp.glob("ray/ray_current_cluster"))):
            assert head.poll() is None and time.time() < deadline, "ray start --head did not come up"
            time.sleep(0.5)
        yield port, home, tmp
    finally:
        try:  # the whole group (ray start, gcs_server, raylet, workers): no 30 s drain, no other cluster touched
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        head.wait(30)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.ray
def test_a_token_cluster_is_joined_without_auth_mode_and_refusals_say_the_fix_at_once(token_head, tmp_path):
    port, home, tmp = token_head
    dead = _free_port()
    cases = {
        "no_token": {"RAY_ADDRESS": f"127.0.0.1:{port}"},
        "wrong_token": {"RAY_ADDRESS": f"127.0.0.1:{port}", "RAY_AUTH_TOKEN": "0" * 32},
        "auth_disabled": {"RAY_ADDRESS": f"127.0.0.1:{port}", "RAY_AUTH_MODE": "disabled"},
        "dead_address": {"RAY_ADDRESS": f"127.0.0.1:{dead}"},
    }
    out = _run(CASES, _env(HOME=str(tmp_path), TOKEN_HOME=str(home), RAY_TMPDIR=str(tmp), CASES=json.dumps(cases)))
    join = out.pop("join")
    assert join["gcs"].rsplit(":", 1)[1] == str(port), "joined another cluster than the one ray start started"
    assert join["auth"] == "token" and join["task"] == 42
    assert out.pop("initialized") is False, "a refused run started a cluster"
    assert "requires token authentication and this shell has no token" in out["no_token"][0]
    assert "~/.ray/auth_token" in out["no_token"][0] and "RAY_AUTH_TOKEN" in out["no_token"][0]
    assert "refuses this shell's token" in out["wrong_token"][0]
    assert "RAY_AUTH_MODE=disabled" in out["auth_disabled"][0]
    assert f"no Ray cluster listens at 127.0.0.1:{dead}" in out["dead_address"][0]
    assert all("\n" not in msg and s < 10 for msg, s in out.values()), out  # not 20 s of retries


def test_only_an_address_where_nothing_listens_is_dead():
    from ray_mmbatch.run.cluster import join_check

    assert join_check(f"127.0.0.1:{_free_port()}") == "dead"
    with socket.socket() as server:  # something listens but is no Ray GCS: never called stale
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert join_check(f"127.0.0.1:{server.getsockname()[1]}", timeout=1.0) == "?"
    assert join_check("ray://head:10001") == "?" and join_check("auto") == "?"  # Ray Client / Ray's own lookup


LOCAL = """
import json, os, ray
from ray_mmbatch.train.trainer import connect
connect(num_cpus=2)
seen = ray.get(ray.remote(lambda: os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")).remote())
print("RESULT " + json.dumps({"seen": seen}))
"""


@pytest.mark.ray
def test_a_cluster_started_here_polls_train_workers_twice_a_second():
    """Ray Train's controller noticed a finished run up to ~4 s late at its 2 s default; the cluster connect()
    starts has every process inherit a 0.5 s poll (a value the user set is kept: os.environ.setdefault).
    A fresh process, starting (and stopping) its own local cluster."""
    from ray_mmbatch.train.trainer import LOCAL_TRAIN_POLL_S, TRAIN_POLL_ENV

    short = Path(tempfile.mkdtemp(prefix="rmp", dir="/tmp"))  # Ray's socket paths must stay short
    try:
        base = {k: v for k, v in _env(RAY_TMPDIR=str(short)).items() if k != TRAIN_POLL_ENV}
        assert _run(LOCAL, base)["seen"] == LOCAL_TRAIN_POLL_S == "0.5"
    finally:
        shutil.rmtree(short, ignore_errors=True)
