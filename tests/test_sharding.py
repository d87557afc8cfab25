"""Sharding: every rank's share computed in one process, checked against counts derived by hand and plan.py."""

import math

import numpy as np
import pytest

from eyas.core.errors import EyasError
from eyas.train.plan import compute_plan
from eyas.train.sharding import ShardSpec, audit, epoch_order, pack, shard_epoch


def lengths_for(n, seed=0):
    return np.random.default_rng(seed).integers(3, 200, n)


def shares(lengths, spec, epoch=0):
    return [shard_epoch(lengths, epoch, r, spec) for r in range(spec.world_size)]


@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 13, 101, 257])
def test_disjoint_and_complete_padded(world, n):
    L = lengths_for(n)
    for mb, ga in [(1, 1), (3, 2)]:
        spec = ShardSpec(world_size=world, micro_batch=mb, grad_accum=ga, seed=5)
        sh = shares(L, spec)
        own = [s.sample_ids()[0] for s in sh]
        reps = [s.sample_ids()[1] for s in sh]
        flat = sorted(i for o in own for i in o)
        assert flat == list(range(n))  # every sample exactly once as a first occurrence
        per_rank = math.ceil(n / world)
        assert all(len(o) + len(r) == per_rank for o, r in zip(own, reps))  # equal shares
        assert sum(len(r) for r in reps) == per_rank * world - n  # the padding, counted
        assert all(i in set(flat) for r in reps for i in r)  # repeats are real samples
        # equal micro-batch and step counts on every rank (collectives never hang), equal to plan.py's
        plan = compute_plan(n, world, mb, ga)
        assert {len(s.micro_batches) for s in sh} == {plan.micro_batches_per_rank_per_epoch}
        assert {len(s.steps) for s in sh} == {plan.optimizer_steps_per_epoch}
        assert plan.padded_samples == sum(len(r) for r in reps)


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n", [9, 31, 100])
def test_drop_remainder_counts(world, n):
    L = lengths_for(n, 1)
    spec = ShardSpec(world_size=world, micro_batch=2, grad_accum=2, drop_remainder=True)
    if n < world * 4:  # not one global batch: nothing to train on, and plan.py refuses
        assert all(not s.steps for s in shares(L, spec))
        with pytest.raises(EyasError, match="do not fill one global batch"):
            compute_plan(n, world, 2, 2, drop_remainder=True)
        return
    sh = shares(L, spec)
    own = [i for s in sh for i in s.sample_ids()[0]]
    plan = compute_plan(n, world, 2, 2, drop_remainder=True)
    assert len(own) == len(set(own)) == n - plan.dropped_samples
    assert all(not s.sample_ids()[1] for s in sh)
    assert {len(s.micro_batches) for s in sh} == {plan.micro_batches_per_rank_per_epoch}
    assert {len(s.steps) for s in sh} == {plan.optimizer_steps_per_epoch}
    assert sh[0].dropped_samples == plan.dropped_samples
    a = audit([s.sample_ids() for s in sh], n, expected_dropped=sh[0].dropped_samples)
    assert a.ok and a.dropped == plan.dropped_samples


def test_reshuffled_per_epoch_and_seeded():
    a, b = epoch_order(50, 0, seed=1), epoch_order(50, 1, seed=1)
    assert sorted(a) == sorted(b) == list(range(50)) and list(a) != list(b)
    assert list(epoch_order(50, 0, seed=1)) == list(a)
    assert list(epoch_order(50, 0, seed=2)) != list(a)
    assert list(epoch_order(5, 3, seed=1, shuffle=False)) == [0, 1, 2, 3, 4]


def test_step_membership_does_not_depend_on_world_size():
    """W ranks x accum 1 and one process x accum W train on the same samples in every optimizer step: the
    property behind 'two-process DDP equals one process with the same global batch'."""
    L = lengths_for(96, 3)
    one = shard_epoch(L, 0, 0, ShardSpec(world_size=1, micro_batch=2, grad_accum=4))
    four = shares(L, ShardSpec(world_size=4, micro_batch=2, grad_accum=1))
    assert len(one.steps) == len(four[0].steps) == 12
    for s in range(12):
        want = sorted(i for mb in one.steps[s] for u in mb for i in u)
        got = sorted(i for r in four for mb in r.steps[s] for u in mb for i in u)
        assert got == want


def test_balanced_deal_evens_the_tokens():
    L = lengths_for(400, 4)
    sh = shares(L, ShardSpec(world_size=4, micro_batch=4, grad_accum=1))
    for s in range(len(sh[0].steps)):
        loads = [sum(int(L[i]) for mb in r.steps[s] for u in mb for i in u) for r in sh]
        assert max(loads) - min(loads) <= L.max()  # greedy longest-first: within one sample


def test_packing_respects_max_tokens_and_covers():
    L = lengths_for(300, 5)
    units = pack(np.arange(300), L, 512)
    assert sorted(i for u in units for i in u) == list(range(300))
    assert all(sum(L[i] for i in u) <= 512 for u in units)
    assert len(units) < 300 * 0.6  # actually packs (mean length ~100)
    long = pack(np.arange(3), np.array([10, 900, 20]), 512)
    assert (1,) in long  # a sample longer than max_tokens is its own unit
    spec = ShardSpec(world_size=3, max_tokens=512, seed=2)
    sh = shares(L, spec)
    own = sorted(i for s in sh for i in s.sample_ids()[0])
    assert own == list(range(300))
    assert len({len(s.micro_batches) for s in sh}) == 1
    a = audit([s.sample_ids() for s in sh], 300, units=sh[0].total_units)
    assert a.ok and "packed sequences (global)" in a.line()


def test_audit_line_of_the_seed_case():
    L = np.ones(35446, dtype=np.int64)
    sh = shares(L, ShardSpec(world_size=4, shuffle=False, balance=False))
    a = audit([s.sample_ids() for s in sh], 35446)
    assert a.line() == "data: 35,446 samples over 4 ranks -> 8,862 per rank per epoch (2 padded), disjoint: yes"
    assert a.ok and a.to_dict()["disjoint"] is True


def test_unsharded_configuration_fails_the_audit():
    L = lengths_for(20)
    sh = shares(L, ShardSpec(world_size=2, sharded=False))
    a = audit([s.sample_ids() for s in sh], 20)
    assert not a.ok and a.duplicates == 20
    assert "disjoint: NO: 20 samples on more than one rank" in a.line()
    assert "20 per rank per epoch" in a.line()


def test_audit_finds_missing_and_duplicated_ids():
    gathered = [([0, 1, 2], []), ([2, 3], [0])]  # 2 twice, 4 nowhere
    a = audit(gathered, 5)
    assert a.duplicates == 1 and a.duplicate_examples == (2,) and a.missing == 1 and not a.ok
    assert "1 samples on no rank" in a.line()


def test_length_grouping_cuts_padding_and_keeps_steps_random():
    L = lengths_for(512, 6)

    def waste(spec):
        sh = shard_epoch(L, 0, 0, spec)
        pad = sum(len(mb) * max(L[u[0]] for u in mb) - sum(L[u[0]] for u in mb) for mb in sh.micro_batches)
        return pad / sum(L[u[0]] for mb in sh.micro_batches for u in mb), sh

    grouped, sh = waste(ShardSpec(world_size=1, micro_batch=8))
    plain, _ = waste(ShardSpec(world_size=1, micro_batch=8, group_window=0))
    assert grouped < 0.1 * plain  # similar lengths share a micro-batch
    longest = [max(L[u[0]] for u in mb) for mb in sh.micro_batches]
    assert longest != sorted(longest) and longest != sorted(longest, reverse=True)  # steps stay shuffled
