"""Config validation, load_config and the fingerprint (no Ray, no torch needed)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from memckpt.config import (ChaosEvent, Config, FailureConfig, LoadSpec, PersistTier,
                            PlacementConfig, WorkersConfig, load_config)
from memckpt.errors import ConfigError, MemckptError

REPO = Path(__file__).resolve().parent.parent


def _err(fn) -> str:
    with pytest.raises(ConfigError) as ei:
        fn()
    assert isinstance(ei.value, MemckptError) and isinstance(ei.value, ValueError)
    return str(ei.value)


# (id, constructor, field the message must name, value it must show, words of the fix)
INVALID = [
    ("snapshot_every_zero", lambda: Config(snapshot_every=0),
     "snapshot_every", "0", ">= 1"),
    ("snapshot_every_bool", lambda: Config(snapshot_every=True),
     "snapshot_every", "True", ">= 1"),
    ("snapshot_mode", lambda: Config(snapshot_mode="async"),
     "snapshot_mode", "'async'", "sync, overlap"),
    ("replicas_ge_nodes", lambda: Config(workers=WorkersConfig(num_workers=3),
                                         placement=PlacementConfig(replicas=3)),
     "placement.replicas", "3", "lower placement.replicas to <= 2"),
    ("group_too_small", lambda: Config(workers=WorkersConfig(num_workers=4),
                                       placement=PlacementConfig(strategy="group", replicas=2,
                                                                 group_size=2)),
     "placement.group_size", "2", "raise placement.group_size"),
    ("unknown_strategy", lambda: PlacementConfig(strategy="star"),
     "placement.strategy", "'star'", "ring, group, mixed"),
    ("standby_negative", lambda: PlacementConfig(standby_nodes=-1),
     "placement.standby_nodes", "-1", ">= 0"),
    ("standby_without_replicas", lambda: PlacementConfig(replicas=0, standby_nodes=1),
     "placement.standby_nodes", "1", "placement.replicas >= 1"),
    ("standby_second_copy_needs_peers", lambda: Config(workers=WorkersConfig(num_workers=1),
                                                       placement=PlacementConfig(
                                                           replicas=2, standby_nodes=1)),
     "placement.replicas", "1", "standby node(s) hold 1 of the 2"),
    ("keep_last_zero", lambda: PersistTier(uri="/tmp/ckpt", keep_last=0),
     "persistence.keep_last", "0", ">= 1"),
    ("persist_every_zero", lambda: PersistTier(uri="/tmp/ckpt", every=0),
     "persistence.every", "0", ">= 1"),
    ("s3_empty", lambda: PersistTier(uri="s3://"),
     "persistence.uri", "'s3://'", "s3://bucket/prefix"),
    ("s3_bad_bucket", lambda: PersistTier(uri="s3://Bad_Bucket/x"),
     "persistence.uri", "'s3://Bad_Bucket/x'", "lowercase"),
    ("s3_one_slash", lambda: PersistTier(uri="s3:/bucket"),
     "persistence.uri", "'s3:/bucket'", "s3://bucket/prefix"),
    ("s3_short_bucket", lambda: PersistTier(uri="s3://ab/x"),
     "persistence.uri", "'s3://ab/x'", "3-63"),
    ("s3_dotdot_bucket", lambda: PersistTier(uri="s3://my..bucket/x"),
     "persistence.uri", "'s3://my..bucket/x'", "s3://bucket/prefix"),
    ("other_scheme", lambda: PersistTier(uri="gs://bucket/x"),
     "persistence.uri", "'gs://bucket/x'", "s3://"),
    ("empty_uri", lambda: PersistTier(uri="  "),
     "persistence.uri", "'  '", "local directory"),
    ("duplicate_tiers", lambda: Config(persistence=(PersistTier("/tmp/a"), PersistTier("/tmp/a"))),
     "persistence", "'/tmp/a'", "its own uri"),
    ("negative_interval", lambda: FailureConfig(heartbeat_interval_s=-1.0),
     "failure.heartbeat_interval_s", "-1.0", "> 0"),
    ("negative_timeout", lambda: FailureConfig(heartbeat_timeout_s=-5),
     "failure.heartbeat_timeout_s", "-5", "> 0"),
    ("nan_timeout", lambda: FailureConfig(heartbeat_timeout_s=float("nan")),
     "failure.heartbeat_timeout_s", "nan", "finite"),
    ("timeout_not_above_twice_interval", lambda: FailureConfig(heartbeat_interval_s=1.0,
                                                               heartbeat_timeout_s=2.0),
     "failure.heartbeat_timeout_s", "2.0", "twice failure.heartbeat_interval_s=1.0"),
    ("negative_restarts", lambda: FailureConfig(max_restarts=-1),
     "failure.max_restarts", "-1", ">= 0"),
    ("fall_behind_policy", lambda: FailureConfig(on_fall_behind="drop"),
     "failure.on_fall_behind", "'drop'", "wait, skip"),
    ("load_content_kind", lambda: LoadSpec(content=("model", "weights")),
     "load.content", "'weights'", "all, model, optimizer"),
    ("load_content_empty", lambda: LoadSpec(content=()),
     "load.content", "()", "at least one"),
    ("chaos_rank_out_of_range", lambda: Config(workers=WorkersConfig(num_workers=2),
                                               chaos=(ChaosEvent(step=5, rank=2),)),
     "chaos.rank", "2", "ranks run from 0 to 1"),
    ("chaos_rank_missing", lambda: ChaosEvent(step=5, target="worker"),
     "chaos.rank", "None", "needs the rank"),
    ("chaos_step_zero", lambda: ChaosEvent(step=0, rank=0),
     "chaos.step", "0", ">= 1"),
    ("chaos_target", lambda: ChaosEvent(step=1, target="gpu", rank=0),
     "chaos.target", "'gpu'", "worker, node, random"),
    ("chaos_steady_not_bool", lambda: ChaosEvent(step=1, rank=0, steady="yes"),
     "chaos.steady", "'yes'", "True or False"),
    ("chaos_at_byte_negative", lambda: ChaosEvent(step=1, target="node", rank=0, at_byte=-1),
     "chaos.at_byte", "-1", ">= 0"),
    ("chaos_at_byte_store", lambda: ChaosEvent(step=1, target="store", rank=0, at_byte=10),
     "chaos.at_byte", "10", "target 'worker' or 'node'"),
    ("chaos_at_byte_ranks", lambda: ChaosEvent(step=1, target="node", ranks=(0, 1), at_byte=10),
     "chaos.at_byte", "10", "the rank whose shard is sent"),
    ("workers_per_node_not_dividing", lambda: WorkersConfig(num_workers=3, workers_per_node=2),
     "workers.workers_per_node", "2", "divide workers.num_workers=3"),
    ("num_workers_zero", lambda: WorkersConfig(num_workers=0),
     "workers.num_workers", "0", ">= 1"),
    ("warm_spares", lambda: FailureConfig(warm_spares=1),
     "failure.warm_spares", "1", "True or False"),
    ("backend", lambda: WorkersConfig(backend="mpi"),
     "workers.backend", "'mpi'", "auto, gloo, nccl"),
    ("job_name", lambda: Config(job_name="my job"),
     "job_name", "'my job'", "letters, digits"),
    ("workers_type", lambda: Config(workers=4),
     "workers", "4", "memckpt.WorkersConfig"),
    ("persistence_type", lambda: Config(persistence=["/tmp/x"]),
     "persistence", "'/tmp/x'", "memckpt.PersistTier"),
]


@pytest.mark.parametrize("make,field,value,fix", [c[1:] for c in INVALID],
                         ids=[c[0] for c in INVALID])
def test_invalid_values_name_field_value_and_fix(make, field, value, fix):
    msg = _err(make)
    assert field in msg, msg
    assert value in msg, msg
    assert fix in msg, msg


def test_valid_configs_construct_and_normalise():
    cfg = Config(
        job_name="gpt-small.v2",
        workers=WorkersConfig(num_workers=8, workers_per_node=2),
        placement=PlacementConfig(strategy="group", replicas=1, group_size=2),
        persistence=[PersistTier("s3://my-bucket.data/ckpt/run1", every=50),
                     PersistTier("/tmp/memckpt-local", keep_last=3)],
        failure=FailureConfig(heartbeat_interval_s=1, heartbeat_timeout_s=2.5),
        load=LoadSpec(content="model"),
        chaos=ChaosEvent(step=10, rank=7),
    )
    assert cfg.workers.num_nodes == 4
    assert isinstance(cfg.persistence, tuple) and cfg.persistence[0].is_s3
    assert not cfg.persistence[1].is_s3
    assert cfg.chaos == (ChaosEvent(step=10, rank=7),)
    assert cfg.load.content == ("model",) and cfg.load.kinds() == {"model"}
    assert LoadSpec(ignore_data_position=True).kinds() == {
        "model", "optimizer", "scheduler", "scaler", "rng", "extras"}
    # replicas are only checked when there is more than one node
    assert Config(placement=PlacementConfig(replicas=3)).workers.num_nodes == 1
    with pytest.raises(AttributeError):
        cfg.snapshot_every = 2  # frozen


def test_load_config_reads_the_config_variable(tmp_path):
    path = tmp_path / "job_config.py"
    path.write_text(textwrap.dedent("""
        import memckpt
        config = memckpt.Config(job_name="from-file", snapshot_every=5,
                                workers=memckpt.WorkersConfig(num_workers=4, workers_per_node=2),
                                persistence=[memckpt.PersistTier("s3://bucket-1/p", every=10)])
    """))
    cfg = load_config(path)
    assert cfg == Config(job_name="from-file", snapshot_every=5,
                         workers=WorkersConfig(num_workers=4, workers_per_node=2),
                         persistence=(PersistTier("s3://bucket-1/p", every=10),))
    assert load_config(str(path)) == cfg


def test_load_config_missing_file(tmp_path):
    missing = tmp_path / "nope.py"
    msg = _err(lambda: load_config(missing))
    assert str(missing) in msg and "does not exist" in msg and "config = memckpt.Config" in msg


def test_load_config_file_without_config(tmp_path):
    path = tmp_path / "empty_config.py"
    path.write_text("import memckpt\ncfg = memckpt.Config()\n")
    msg = _err(lambda: load_config(path))
    assert str(path) in msg and "must define `config = memckpt.Config(...)`" in msg
    assert "NoneType" in msg
    path.write_text("config = {'snapshot_every': 1}\n")
    msg = _err(lambda: load_config(path))
    assert "found config=dict" in msg


def test_load_config_invalid_value_names_the_file(tmp_path):
    path = tmp_path / "bad_config.py"
    path.write_text("import memckpt\nconfig = memckpt.Config(snapshot_every=0)\n")
    msg = _err(lambda: load_config(path))
    assert str(path) in msg and "snapshot_every=0" in msg


FINGERPRINT_CONFIG = """
import memckpt
config = memckpt.Config(
    job_name="fp", snapshot_every=4,
    workers=memckpt.WorkersConfig(num_workers=4, workers_per_node=2),
    placement=memckpt.PlacementConfig(strategy="ring", replicas=1),
    persistence=[memckpt.PersistTier("s3://bucket-a/run", every=20)],
)
"""


def test_fingerprint_is_stable_across_processes(tmp_path):
    path = tmp_path / "fp_config.py"
    path.write_text(FINGERPRINT_CONFIG)
    here = load_config(path).fingerprint()
    assert len(here) == 16 and int(here, 16) >= 0
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from memckpt.config import load_config; "
                               "print(load_config(sys.argv[1]).fingerprint())", str(path)],
        capture_output=True, text=True, env=env, timeout=120, check=True)
    assert out.stdout.strip() == here


def test_fingerprint_tracks_layout_not_drills():
    base = Config(snapshot_every=4, workers=WorkersConfig(num_workers=4, workers_per_node=2))
    fp = base.fingerprint()
    assert Config(snapshot_every=4, workers=WorkersConfig(num_workers=4, workers_per_node=2)
                  ).fingerprint() == fp
    changed = [
        Config(snapshot_every=5, workers=WorkersConfig(num_workers=4, workers_per_node=2)),
        Config(snapshot_every=4, workers=WorkersConfig(num_workers=4, workers_per_node=1)),
        Config(snapshot_every=4, workers=WorkersConfig(num_workers=4, workers_per_node=2),
               snapshot_mode="overlap"),
        Config(snapshot_every=4, workers=WorkersConfig(num_workers=4, workers_per_node=2),
               persistence=[PersistTier("/tmp/p")]),
    ]
    for other in changed:
        assert other.fingerprint() != fp, other
    same = [
        Config(snapshot_every=4, workers=WorkersConfig(num_workers=4, workers_per_node=2),
               chaos=[ChaosEvent(step=3, rank=1), ChaosEvent(step=9, target="random")]),
        Config(snapshot_every=4, workers=WorkersConfig(num_workers=4, workers_per_node=2),
               job_name="another-name", ram_root="/dev/shm/elsewhere"),
    ]
    for other in same:
        assert other.fingerprint() == fp, other


def test_a_steady_chaos_event_schedules_a_steady_fault():
    from memckpt.runtime.chaos.faults import Fault
    assert Fault.from_chaos(ChaosEvent(step=4, rank=1, steady=True)).steady is True
    assert Fault.from_chaos(ChaosEvent(step=4, rank=1)).steady is False


def _documented_defaults() -> dict[str, dict[str, str]]:
    """docs/configuration.md: dataclass name -> field -> the default column's first code span."""
    import re
    out: dict[str, dict[str, str]] = {}
    section = None
    page = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
    for line in page.read_text().splitlines():
        if m := re.match(r"^## `(\w+)`$", line):
            section = m.group(1)
            out[section] = {}
        elif section and (m := re.match(r"^\| `(\w+)` \| ([^|]*) \|", line)):
            code = re.match(r"`([^`]*)`", m.group(2).strip())
            out[section][m.group(1)] = code.group(1) if code else m.group(2).strip()
    return out


def test_documented_defaults_are_the_dataclasses_defaults():
    """Each table of docs/configuration.md names every field of its dataclass, with the
    default the code has: a default changed in one place fails here until the other follows."""
    import ast
    import dataclasses

    import memckpt
    documented = _documented_defaults()
    assert set(documented) >= {"Config", "WorkersConfig", "PlacementConfig", "PersistTier",
                               "EngineConfig", "FailureConfig", "LoadSpec", "ChaosEvent"}
    for name, fields in documented.items():
        cls = getattr(memckpt, name)
        own = {f.name: f for f in dataclasses.fields(cls) if f.init}
        assert set(fields) == set(own), f"{name}: documented {sorted(fields)}, fields {sorted(own)}"
        for field_name, text in fields.items():
            f = own[field_name]
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                assert text == "(required)", f"{name}.{field_name} has no default, the docs say {text}"
                continue
            code = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if text.endswith("()") and text[:-2].isidentifier():
                said = getattr(memckpt, text[:-2])()
            else:
                said = ast.literal_eval(text)
            assert said == code and type(said) is type(code) or \
                isinstance(code, float) and said == code, \
                f"{name}.{field_name}: docs/configuration.md says {text}, the code {code!r}"
