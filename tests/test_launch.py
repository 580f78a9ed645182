"""`memckpt run`'s loading of TRAIN and CONFIG, without starting Ray."""

from __future__ import annotations

import pytest

from memckpt.errors import ConfigError
from memckpt.cli.run import load_train_fn


def test_module_function():
    fn = load_train_fn("memckpt.demo.job:GPTJob")
    assert fn.__name__ == "GPTJob"


def test_path_function(tmp_path):
    f = tmp_path / "my_train.py"
    f.write_text("def train(ctx):\n    return 41 + 1\n")
    fn = load_train_fn(f"{f}:train")
    assert fn(None) == 42


def test_example_job_loads():
    job = load_train_fn("examples/gpt_job.py:train")
    assert callable(job) and job.steps > 0


def test_fsdp_example_job_and_config_load():
    from memckpt.config import load_config
    job = load_train_fn("examples/fsdp_job.py:train")
    assert type(job).__name__ == "FSDPJob" and job.steps > 0
    config = load_config("examples/fsdp_config.py")
    assert config.workers.num_workers % job.tp == 0


@pytest.mark.parametrize("tp", [0, -2, 1.5, True])
def test_fsdp_job_rejects_a_bad_tp(tp):
    from memckpt.demo.job import FSDPJob
    with pytest.raises(ValueError, match="use a whole number >= 1"):
        FSDPJob(tp=tp)


@pytest.mark.parametrize("spec, fix", [
    ("no_colon", "module:function"),
    ("missing_file.py:train", "does not exist"),
    ("memckpt.nope_module:train", "cannot import"),
    ("memckpt.demo.job:nothing_here", "no function 'nothing_here'"),
])
def test_bad_train_specs(spec, fix):
    with pytest.raises(ConfigError, match=fix):
        load_train_fn(spec)


def test_cli_run_with_missing_config_exits_2(capsys):
    from memckpt.cli import main
    assert main(["run", "memckpt.demo.job:GPTJob", "--config", "nope.py"]) == 2
    assert "does not exist" in capsys.readouterr().err
