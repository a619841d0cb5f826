"""The -n 2 scheduler's unit (conftest.touches_ray): every module that uses Ray, runs a command, job or subprocess,
or starts a Train / Tune run is one unit of work on one worker; a module without any of these is spread test by
test. A docstring naming jobs/X.py does not count."""
from __future__ import annotations

from pathlib import Path

import pytest
from conftest import touches_ray

TESTS = Path(__file__).parent


@pytest.mark.parametrize("module", ["test_docs.py", "test_job_submit.py", "test_connect.py", "test_train.py",
                                    "test_tune.py", "test_multinode.py", "test_pipeline.py", "test_video.py"])
def test_modules_that_use_ray_or_start_processes_are_one_unit(module):
    assert touches_ray(str(TESTS / module))


def test_each_marker_makes_a_module_touch_ray_and_a_docstring_naming_a_job_does_not(tmp_path):
    assert not touches_ray(str(TESTS / "test_collate.py"))
    for k, extra in enumerate(("def test_x(ray_cluster): pass", "import subprocess", "import ray",
                               "args = ['python', 'jobs/train.py']", 'args = ["python", "jobs/train.py"]',
                               "from ray_mmbatch.cli import main as m\nm([])  # cli.main", "run_training(cfg)",
                               "tune_budgets(cfg)", "pytestmark = pytest.mark.slow")):
        path = tmp_path / f"test_m{k}.py"
        path.write_text(f'"""A module."""\n{extra}\n')
        assert touches_ray(str(path)), extra
    doc = tmp_path / "test_doc.py"
    doc.write_text('"""jobs/train.py runs this; only the planner is checked here."""\n\n\ndef test_x():\n    pass\n')
    assert not touches_ray(str(doc))
