"""The shipped cluster configs parse and say what the guide promises."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from memckpt.runtime.tools.local_cluster import FAST_HEALTH_CHECKS

ROOT = Path(__file__).resolve().parents[1] / "cluster"


def test_ray_cluster_launcher_yaml():
    cfg = yaml.safe_load((ROOT / "ray-cluster.yaml").read_text())
    assert cfg["head_node_type"] in cfg["available_node_types"]
    assert cfg["available_node_types"]["head"]["resources"] == {"CPU": 0}
    setup = " ".join(cfg["setup_commands"])
    assert "torch==2.13.0" in setup and setup.index("torch==2.13.0") < setup.index("memckpt")
    head = " ".join(cfg["head_start_ray_commands"])
    assert "--num-cpus=0" in head
    assert json.loads(re.search(r"--system-config='([^']*)'", head).group(1)) == FAST_HEALTH_CHECKS


def test_kuberay_rayjob_yaml():
    job = yaml.safe_load((ROOT / "rayjob.yaml").read_text())
    assert job["kind"] == "RayJob" and job["apiVersion"] == "ray.io/v1"
    spec = job["spec"]
    assert spec["entrypoint"].startswith("memckpt run examples/gpt_job.py:train")
    assert Path(__file__).resolve().parents[1].joinpath("examples", "gpt_job.py").exists()
    workers = spec["rayClusterSpec"]["workerGroupSpecs"][0]
    assert workers["replicas"] == 3
    volumes = workers["template"]["spec"]["volumes"]
    assert any(v["name"] == "dshm" and v["emptyDir"]["medium"] == "Memory" for v in volumes)
    head = spec["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]
    assert head["num-cpus"] == "0"
    assert json.loads(head["system-config"]) == FAST_HEALTH_CHECKS  # the same as LocalCluster's


def test_the_guide_recommends_the_same_health_checks():
    guide = (ROOT.parent / "docs" / "operations.md").read_text()  # the cluster guide
    quoted = re.search(r"--system-config='([^']*)'", guide).group(1)
    assert json.loads(quoted) == FAST_HEALTH_CHECKS


def test_local_cluster_script_usage():
    res = subprocess.run(["bash", str(ROOT / "local-cluster.sh")], capture_output=True, text=True)
    assert res.returncode == 2 and "usage" in res.stdout
    assert subprocess.run(["bash", "-n", str(ROOT / "local-cluster.sh")]).returncode == 0


def test_local_cluster_refuses_bad_sizes_and_ports_in_one_line():
    """``python -m memckpt.runtime.tools.local_cluster`` (behind cluster/local-cluster.sh) checks
    its numbers before it starts anything: exit 2 and the usage's one error line."""
    for args, says in ((["--nodes", "0"], "--nodes and --cpus-per-node must be >= 1"),
                       (["--dashboard-port", "70000"], "--dashboard-port must be a TCP port "
                        "(1-65535, or 0 for any free one), not 70000"),
                       (["--dashboard-port", "-1"], "--dashboard-port must be a TCP port "
                        "(1-65535, or 0 for any free one), not -1")):
        res = subprocess.run([sys.executable, "-m", "memckpt.runtime.tools.local_cluster", *args],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 2, res.stderr
        assert res.stderr.splitlines()[-1].endswith(f"error: {says}"), res.stderr
        assert "Traceback" not in res.stderr
