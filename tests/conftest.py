"""Shared fixtures: one local Ray cluster for the whole session, generated data."""
from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
# Ray Train's controller polls its workers every 2 s (Ray's default), so a finished run waited up to 4 s
# more for the controller to see it: every Train and Tune run of the suite paid that (~3.5 s a run,
# measured on the docs' 64-sample train command: 25.9 -> 22.4 s). Its preemption watcher is one more actor
# process a run starts; the tests preempt nodes with Cluster.remove_node, which it does not watch.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The S3-compatible server of the object-store tests (tests/test_formats_s3.py) listens on S3_PORT.
# Set before the shared Ray cluster starts, so its workers inherit the endpoint and the fake keys
# (the standard AWS variables pyarrow reads); no test can reach a real bucket.
S3_PORT = _free_port()
os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{S3_PORT}", AWS_ACCESS_KEY_ID="testing",
                  AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1", AWS_REGION="us-east-1",
                  AWS_EC2_METADATA_DISABLED="true")
for _var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
    os.environ.pop(_var, None)


#: What marks a test module as one that touches Ray: the shared cluster, a cluster of its own, a command, job or
#: Train / Tune run that starts or joins one, a subprocess (which may: a CLI run joins the cluster `ray start` last
#: started here, so it must not overlap a test's own), the ray / slow markers. A docstring naming jobs/X.py is not one.
_TOUCHES_RAY = re.compile(r"\bray(?:\.|_cluster\b|-mmbatch\b)|\b(?:from|import) ray\b|\bsubprocess\b|"
                          r"(?<!\"\")[\"']jobs/|cli\.main|commands\.\w+ import main|run_training|tune_budgets|"
                          r"mark\.(?:ray|slow)\b")


@functools.cache
def touches_ray(path: str) -> bool:
    return bool(_TOUCHES_RAY.search(Path(path).read_text()))


@pytest.hookimpl(optionalhook=True)  # an xdist hook: a run without xdist never calls it
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (the README's test command runs ``-n 2``): every test of a module that touches Ray is
    one unit of work, run by one worker in file order, so one shared cluster serves them all and two Ray runs
    never compete for the 2 cores. Each test of the other modules (models, batching, formats, text: in-process
    CPU work, ~a quarter of the suite) is a unit of its own, spread over both workers, so they fill the CPU that
    the Ray runs leave idle (process starts, polls, waits on actors). A scheduler, not xdist_group marks:
    xdist 3.8 names a group by rewriting ``item._nodeid``, which pytest 9 no longer reads."""
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath

    class RayModulesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "ray" if touches_ray(str(root / nodeid.split("::", 1)[0])) else nodeid

    return RayModulesTogether(config, log)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster shared by every Ray test (start-up costs ~7 s).

    ``"local"`` always starts a fresh cluster, so a stale cluster file from a
    ``ray start`` elsewhere cannot interfere. 8 logical CPUs on 2 cores lets two
    Train workers and the Ray Data actor pools (which hold their CPU slots) be
    scheduled side by side; otherwise a 2-worker fit waits forever for a slot.
    """
    import ray

    if not ray.is_initialized():
        ray.init("local", num_cpus=8, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def small_parquet_dataset(tmp_path_factory):
    """A small generated dataset (Parquet, HF style) shared by the Train / job tests."""
    from ray_mmbatch.synthetic.generate import generate_dataset

    out = tmp_path_factory.mktemp("small_parquet")
    generate_dataset(str(out), 240, "parquet", seed=7, shard_size=60)
    return out
