"""Every ``memckpt`` command, run as a real process against no Ray cluster, a missing path and
a bad value, ends in one line (naming ``--address`` / ``RAY_ADDRESS`` where a cluster is
needed) and exit code 2 (1 where the check itself failed), never a Python traceback.

No cluster is started. An explicit address is one nothing listens on (a port this test bound
and released); the "auto" case runs in a fresh PID namespace with an empty RAY_TMPDIR, so Ray's
auto-detection cannot find another process's cluster on this machine.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIX = ("--address", "RAY_ADDRESS")


@pytest.fixture
def dead_address():
    """HOST:PORT where nothing listens, for the whole test: the port stays bound (never
    listening, so a connection is refused) until the test ends. A port bound and released
    again could be taken meanwhile by a process of the Ray drills running beside this test,
    and the CLI then waited on something that answered."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def scratch(tmp_path):
    """A fresh working directory with a config and a training function for ``memckpt run``,
    a regular file (a path that cannot be a folder), and an environment without RAY_ADDRESS."""
    (tmp_path / "cfg.py").write_text(
        "import memckpt\nconfig = memckpt.Config(job_name='cli-err')\n")
    (tmp_path / "train.py").write_text("def train(ctx):\n    pass\n")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "raytmp").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MEMCKPT_TRACEBACK")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["RAY_TMPDIR"] = str(tmp_path / "raytmp")  # no latest-cluster file of anyone else
    return tmp_path, env


def memckpt_cli(argv, cwd, env, prefix=(), timeout=120):
    proc = subprocess.run([*prefix, sys.executable, "-m", "memckpt.cli", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def one_line(rc, out, err, code, *words):
    """Exit ``code``, no traceback anywhere, and one line on stderr beyond argparse's usage
    block, naming every one of ``words``."""
    assert "Traceback" not in out + err, out + err
    assert rc == code, (rc, out, err)
    lines = [line for line in err.splitlines()
             if line.strip() and not line.startswith(("usage:", " "))]
    assert len(lines) == 1, err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


# -- no Ray cluster ---------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["status"], ["kill", "--worker", "0"],
                                  ["kill", "--node", "abc"], ["status", "--json"]])
def test_no_cluster_at_the_given_address(scratch, argv, dead_address):
    cwd, env = scratch
    address = dead_address
    line = one_line(*memckpt_cli([*argv, "--address", address, "--job", "nope"], cwd, env), 2, *FIX)
    assert "no Ray cluster answers" in line


def test_no_cluster_at_ray_address(scratch, dead_address):
    cwd, env = scratch
    env = dict(env, RAY_ADDRESS=dead_address)
    line = one_line(*memckpt_cli(["status"], cwd, env), 2, *FIX)
    assert "RAY_ADDRESS=" in line


def test_run_against_no_cluster(scratch, dead_address):
    cwd, env = scratch
    one_line(*memckpt_cli(["run", "train.py:train", "--config", "cfg.py", "--address",
                           dead_address], cwd, env), 2, *FIX)


def _isolated_pids() -> list[str]:
    """A prefix that runs a command in a fresh PID namespace (Ray's "auto" also finds any
    GCS process on the machine), if this machine allows it."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    probe = subprocess.run([unshare, "--pid", "--fork", "--mount-proc", "true"],
                           capture_output=True)
    return [unshare, "--pid", "--fork", "--mount-proc"] if probe.returncode == 0 else []


@pytest.mark.parametrize("argv", [["status"], ["kill", "--random"]])
def test_no_cluster_found_automatically(scratch, argv):
    cwd, env = scratch
    prefix = _isolated_pids()
    if not prefix:
        from ray._private.services import find_gcs_addresses
        if find_gcs_addresses():
            pytest.skip("a Ray cluster runs on this machine and no PID namespace is available "
                        "to hide it from auto-detection")
    line = one_line(*memckpt_cli(argv, cwd, env, prefix=prefix), 2, *FIX)
    assert "no running Ray cluster was found" in line


# -- a missing path ---------------------------------------------------------------------------
@pytest.mark.parametrize("argv,code,words", [
    (["run", "missing.py:train", "--config", "cfg.py"], 2, ["does not exist"]),
    (["run", "train.py:train", "--config", "missing.py"], 2, ["does not exist"]),
    (["export", "missing", "--weights-only", "w.pt"], 2, ["ROOT", "no such folder"]),
    (["export", ".", "--weights-only", "nodir/w.pt"], 2, ["--weights-only"]),
    (["report", "missing"], 2, ["RUN_DIR", "no such folder"]),
    (["demo", "--local", "--tiny", "--summary", "afile/s.json"], 2, ["--summary"]),
    (["bench", "compare", "--from-json", "missing.json"], 2, ["--from-json"]),
    (["bench", "snapshot", "--dir", "afile/sub", "--sizes", "1M"], 2, ["--dir"]),
    (["bench", "persist", "--dir", "afile/sub", "--sizes", "1M"], 2, ["--dir"]),
    (["bench", "recovery", "--dir", "afile/sub", "--state-mb", "1"], 2, ["--dir"]),
    (["bench", "compare", "--dir", "afile/sub", "--sizes", "1M"], 2, ["--dir"]),
])
def test_missing_path(scratch, argv, code, words):
    cwd, env = scratch
    one_line(*memckpt_cli(argv, cwd, env), code, *words)


def test_ls_of_a_missing_root_lists_nothing(scratch):
    """``ls`` shows a root that does not exist yet as empty (as an S3 prefix without objects)."""
    cwd, env = scratch
    rc, out, err = memckpt_cli(["ls", "missing"], cwd, env)
    assert (rc, err) == (0, "") and "Traceback" not in out
    assert out.splitlines() == [f"no checkpoints under {cwd / 'missing'}"]


# -- a bad value ------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,code,words", [
    (["status", "--address", "no-port-here"], 2, ["--address", "HOST:PORT"]),
    (["kill", "--worker", "x"], 2, ["--worker"]),
    (["kill", "--worker", "0", "--signal", "HUP"], 2, ["--signal"]),
    # refused before any cluster is asked (there is none here)
    (["kill", "--node", "abc", "--signal", "TERM"], 2, ["--signal", "KILL", "STOP", "--worker"]),
    (["run", "no-colon", "--config", "cfg.py"], 2, ["TRAIN"]),
    (["ls", "s3:/x"], 2, ["ROOT"]),
    (["export", ".", "--step", "x", "--weights-only", "w.pt"], 2, ["--step"]),
    (["export", ".", "--weights-only", "w.pt"], 1, ["no valid checkpoint"]),  # the check failed
    (["report", "."], 2, ["RUN_DIR", "events.jsonl"]),
    (["demo", "--steps", "0"], 2, ["--steps"]),
    (["demo", "--local", "--steps", "10", "--kill-at", "10"], 2, ["--kill-at"]),
    (["demo", "--fault", "bogus"], 2, ["--fault"]),
    (["bench", "snapshot", "--sizes", "0"], 2, ["--sizes"]),
    (["bench", "persist", "--repeats", "0"], 2, ["--repeats"]),
    (["bench", "recovery", "--state-mb", "0"], 2, ["--state-mb"]),
    (["bench", "compare", "--parts", "bogus"], 2, ["--parts"]),
    (["bench", "bogus"], 2, ["bogus"]),
    (["bogus"], 2, ["bogus"]),
])
def test_bad_value(scratch, argv, code, words):
    cwd, env = scratch
    one_line(*memckpt_cli(argv, cwd, env), code, *words)


def test_unexpected_errors_are_one_line_too(scratch):
    """An error nobody anticipated (here: --json into a path under a regular file, found only
    when the rows are written) is still one line, with the way to see its traceback."""
    cwd, env = scratch
    (cwd / "rows.json").write_text('[{"benchmark": "stall", "method": "none", "size": "1M", '
                                   '"state_bytes": 1048576, "harness": "process", "step_s": 1.0, '
                                   '"blocking_s": 0.0, "compute_s": 1.0, "machine": {"cpus": 2, '
                                   '"ram_bytes": 1, "cuda": false, "torch": "x", "python": "3"}}]')
    line = one_line(*memckpt_cli(["bench", "compare", "--from-json", "rows.json", "--json",
                                  "afile/sub/out.json"], cwd, env), 1, "MEMCKPT_TRACEBACK")
    assert line.startswith("memckpt bench compare: failed:")
