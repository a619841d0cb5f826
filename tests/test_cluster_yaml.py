"""cluster.yaml is valid for the installed Ray's cluster launcher and has the shape the job relies on.

Two layers: the JSON schema Ray ships (ray/autoscaler/ray-schema.json, what `ray up`
validates against) plus Ray's own validate_config after its defaults are filled in,
then our own checks (`problems`) for the things the pipeline needs: a head type, a CPU
type with the `preprocess` resource, a GPU type, setup commands that install the
package, token auth on every node. Broken copies prove each layer can fail.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

REPO = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
PREPROCESS = "preprocess"  # the custom resource name the pipeline requests (docs/cluster.md)


@pytest.fixture
def cluster() -> dict:
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


def problems(cfg: dict) -> list[str]:
    """What the ray_mmbatch job needs from a cluster config; empty list = fine."""
    out = []
    types = cfg.get("available_node_types", {})
    head = cfg.get("head_node_type")
    if head not in types:
        out.append(f"head_node_type {head!r} is not one of {sorted(types)}")
    workers = {k: v for k, v in types.items() if k != head}
    cpu = [k for k, v in workers.items() if v["resources"].get(PREPROCESS, 0) > 0 and not v["resources"].get("GPU")]
    gpu = [k for k, v in workers.items() if v["resources"].get("GPU", 0) > 0]
    if not cpu:
        out.append(f"no CPU worker type with the {PREPROCESS!r} resource")
    if not gpu:
        out.append("no worker type with GPU resources")
    if head in types and types[head]["resources"].get(PREPROCESS):
        out.append("head carries the preprocess resource: data work would land on the head")
    for name in cpu + gpu:
        cmds = " ".join(cfg.get("setup_commands", []) + types[name].get("worker_setup_commands", []))
        if "pip install" not in cmds or "ray_mmbatch" not in cmds:
            out.append(f"{name}: setup commands do not pip install the ray_mmbatch package")
        if "torch" not in cmds:
            out.append(f"{name}: setup commands do not install torch")
    head_cmds = " ".join(cfg.get("setup_commands", []) + cfg.get("head_setup_commands", []))
    if "ray_mmbatch" not in head_cmds:
        out.append("head: setup commands do not install the ray_mmbatch package (job drivers run there)")
    if not any("ray_mmbatch" in remote and remote.endswith("ray_mmbatch") for remote in cfg.get("file_mounts", {})):
        out.append("file_mounts do not carry the ray_mmbatch package")
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        if not any("RAY_AUTH_MODE=token" in c for c in cfg.get(key, [])):
            out.append(f"{key}: token auth (RAY_AUTH_MODE=token) not enabled")
    return out


def test_valid_against_rays_schema(cluster):
    jsonschema.validate(cluster, SCHEMA)
    # Ray's own check after filling provider defaults, as `ray up` does before touching AWS.
    validate_config(prepare_config(copy.deepcopy(cluster)))


def test_has_what_the_job_relies_on(cluster):
    assert problems(cluster) == []
    types = cluster["available_node_types"]
    assert types["cpu"]["resources"][PREPROCESS] == 16 and types["gpu"]["resources"]["GPU"] == 4
    assert sum(t.get("min_workers", 0) for t in types.values()) <= cluster["max_workers"]
    # GPU nodes get CUDA torch, CPU nodes the small CPU wheel.
    assert not any("whl/cpu" in c for c in types["gpu"]["worker_setup_commands"])
    assert any("whl/cpu" in c for c in types["cpu"]["worker_setup_commands"])


def test_file_mounts_point_at_repo_files(cluster):
    pyproject = (REPO / "pyproject.toml").read_text()
    for remote, local in cluster["file_mounts"].items():
        if local.startswith("~"):
            continue  # the auth token lives on the user's machine, not in the repo
        assert local.startswith("./"), f"{remote}: use a repo-relative path, got {local}"
        if local == "./README.md":
            assert 'readme = "README.md"' in pyproject  # only mounted because the build needs it
            continue
        assert (REPO / local).exists(), f"{local} missing: `ray up` would fail to sync it"


@pytest.mark.parametrize("breakage, layer", [
    (lambda c: c.update(worker_nodes_typo={}), "schema"),                       # unknown top-level key
    (lambda c: c["available_node_types"]["cpu"]["resources"].update(preprocess="16"), "schema"),
    (lambda c: c["available_node_types"]["gpu"].update(gpus=4), "schema"),       # unknown node-type key
    (lambda c: c.update(head_node_type="nope"), "ray"),
    (lambda c: c["available_node_types"]["cpu"]["resources"].pop("preprocess"), "ours"),
    (lambda c: c["available_node_types"]["gpu"]["resources"].pop("GPU"), "ours"),
    (lambda c: c["available_node_types"]["gpu"].update(worker_setup_commands=["true"]), "ours"),
    (lambda c: c.update(worker_start_ray_commands=["ray start --address=$RAY_HEAD_IP:6379"]), "ours"),
])
def test_broken_copies_fail(cluster, breakage, layer):
    broken = copy.deepcopy(cluster)
    breakage(broken)
    if layer == "schema":
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, SCHEMA)
    elif layer == "ray":
        jsonschema.validate(broken, SCHEMA)
        with pytest.raises(ValueError, match="head_node_type"):
            validate_config(prepare_config(broken))
    else:
        jsonschema.validate(broken, SCHEMA)
        assert problems(broken), "our checks accepted a config the job cannot use"
