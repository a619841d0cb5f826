"""The -n 2 scheduler's units (conftest.ray_unit): a module that runs a command, job, subprocess, cluster of its
own or Train / Tune run stays on the machine-wide unit; one that uses only its worker's in-process cluster may run
beside it; a module without Ray is spread test by test."""
from __future__ import annotations

from pathlib import Path

import pytest
from conftest import ray_unit

TESTS = Path(__file__).parent


@pytest.mark.parametrize("module", ["test_docs.py", "test_job_submit.py", "test_connect.py", "test_train.py",
                                    "test_tune.py", "test_multinode.py", "test_storage_nodes.py", "test_cli.py",
                                    "test_trackers.py", "test_formats_s3.py", "test_operator.py"])
def test_modules_that_start_or_join_a_cluster_beyond_their_own_stay_on_one_unit(module):
    assert ray_unit(str(TESTS / module)) == "ray"


@pytest.mark.parametrize("module", ["test_pipeline.py", "test_readers.py", "test_video.py", "test_inspect.py"])
def test_modules_on_the_in_process_cluster_only_form_the_second_unit(module):
    assert ray_unit(str(TESTS / module)) == "ray-in-process"


def test_a_module_without_ray_is_spread_and_each_marker_moves_a_module_to_the_machine_wide_unit(tmp_path):
    assert ray_unit(str(TESTS / "test_collate.py")) is None
    in_process = "def test_x(ray_cluster):\n    pass\n"
    for extra in ("import subprocess", "args = ['python', 'jobs/train.py']", "from ray.cluster_utils import Cluster",
                  "ray.init('local')", "os.environ['RAY_ADDRESS'] = 'x'", "from ray.train.torch import TorchTrainer",
                  "connect(4)", "cmd = ['ray', 'start', '--head']"):
        path = tmp_path / f"test_m{abs(hash(extra))}.py"
        path.write_text(in_process + extra + "\n")
        assert ray_unit(str(path)) == "ray", extra
    plain = tmp_path / "test_plain.py"
    plain.write_text(in_process)
    assert ray_unit(str(plain)) == "ray-in-process"
