"""How many hashing threads a rank gets (memckpt.policy.threads): pure, no torch."""

from __future__ import annotations

import pytest

from memckpt.config import Config, EngineConfig
from memckpt.errors import ConfigError
from memckpt.policy.threads import MAX_AUTO_THREADS, hash_threads, local_ranks_from


@pytest.mark.parametrize("setting,cores,ranks,want", [
    (0, 16, 1, 16), (0, 64, 8, 8), (0, 16, 3, 5), (0, 2, 4, 1), (0, 128, 1, MAX_AUTO_THREADS),
    (3, 64, 8, 3), (1, 2, 1, 1)])
def test_cores_are_split_evenly_among_the_ranks_of_a_node(setting, cores, ranks, want):
    assert hash_threads(setting, cores, ranks) == want


def test_bad_inputs_are_refused():
    with pytest.raises(ConfigError, match="must be >= 0"):
        hash_threads(-1, 4, 1)


def test_local_ranks_come_from_the_launcher():
    assert local_ranks_from({}) == 1
    assert local_ranks_from({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert local_ranks_from({"LOCAL_WORLD_SIZE": "x", "MEMCKPT_LOCAL_RANKS": "2"}) == 2


def test_engine_config_is_validated_and_leaves_the_fingerprint_alone():
    with pytest.raises(ConfigError, match="engine.seal_threads=-2 is invalid"):
        EngineConfig(seal_threads=-2)
    with pytest.raises(ConfigError, match="engine.on_sealing='drop' is invalid: choose one of wait, skip"):
        EngineConfig(on_sealing="drop")
    with pytest.raises(ConfigError, match="engine="):
        Config(engine={"seal_threads": 2})
    assert Config().fingerprint() == Config(engine=EngineConfig(seal_threads=3,
                                                                on_sealing="skip")).fingerprint()
