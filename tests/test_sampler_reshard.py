"""ResumableSampler across a world-size change: the global sample sequence, sample by
sample, against the documented rule (dealt in turn from the global position consumed;
no sample repeated, at most M-1 skipped at the end of the epoch)."""

from __future__ import annotations

import pytest

import memckpt


def order(n: int, seed: int, epoch: int) -> list[int]:
    s = memckpt.ResumableSampler(n, shuffle=True, seed=seed)
    s.epoch = epoch
    return list(iter(s))


@pytest.mark.parametrize("n,steps", [(22, 3), (24, 2), (21, 5), (22, 0)])
def test_global_sequence_across_4_to_3(n, steps):
    seed = 5
    old = [memckpt.ResumableSampler(n, seed=seed, rank=r, world_size=4) for r in range(4)]
    its = [iter(s) for s in old]
    seen = []
    for _ in range(steps):  # lockstep: every rank one sample per step
        seen += [next(it) for it in its]
    sd = old[0].state_dict()  # rank 0's state is what a resharded restore loads
    assert sd["consumed"] == 4 * steps and all(s.state_dict() == sd for s in old)

    new = [memckpt.ResumableSampler(n, seed=seed, rank=r, world_size=3) for r in range(3)]
    for s in new:
        s.load_state_dict(dict(sd))
    per_rank = [list(s) for s in new]  # the rest of epoch 0
    rest = n - 4 * steps
    assert all(len(p) == rest // 3 for p in per_rank)
    dealt = [per_rank[r][k] for k in range(rest // 3) for r in range(3)]  # in global order
    epoch0 = order(n, seed, 0)
    assert seen == epoch0[: 4 * steps]
    assert dealt == epoch0[4 * steps: 4 * steps + 3 * (rest // 3)]
    assert len(set(seen + dealt)) == len(seen + dealt)  # nothing repeated
    assert n - len(seen + dealt) == rest % 3 <= 2  # at most M-1 skipped, the epoch's last
    # the next epoch starts from its beginning on the new world size
    nxt = [list(s) for s in new]
    assert [nxt[r][k] for k in range(n // 3) for r in range(3)] == order(n, seed, 1)[: 3 * (n // 3)]
    assert all(s.epoch == 2 for s in new)
