"""The batched lean decoder of `eyas regenerate` against greedy decoding by hand, one prompt at a time."""

import pytest
import torch

from eyas.models.generation import BatchGenerator


def greedy_by_hand(model, prompt: list[int], max_new: int, stops: set[int]) -> list[int]:
    """Argmax of the full forward over everything so far, one token at a time (no cache, no batch)."""
    new = []
    with torch.no_grad():
        for _ in range(max_new):
            t = int(model(torch.tensor([prompt + new])).logits[0, -1].argmax())
            new.append(t)
            if t in stops:
                break
    return new


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(10, 40000, (n,), generator=g).tolist() for n in (5, 17, 1, 30, 11)]


def test_batched_greedy_equals_each_prompt_alone(tiny_target, prompts):
    # rows of different lengths, left-padded into one batch: each decodes as if alone
    want = [greedy_by_hand(tiny_target.model, p, 12, set()) for p in prompts]
    got = BatchGenerator(tiny_target).generate(prompts, 12, stops={49151})
    assert got == want


def test_rows_stop_at_their_own_stop_token(tiny_target, prompts):
    free = [greedy_by_hand(tiny_target.model, p, 12, set()) for p in prompts]
    at = next(i for i, t in enumerate(free[1]) if i >= 2 and t not in free[1][:i])  # first seen mid-row
    stop = free[1][at]
    got = BatchGenerator(tiny_target).generate(prompts, 12, stops={stop})
    for row, full in zip(got, free):
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert row == full[:cut]  # ends with the stop token; other rows go on to max_new
    assert len(got[1]) == at + 1 and any(len(r) == 12 for r in got)


def test_sampling_is_seeded_and_top_p_near_zero_is_greedy(tiny_target, prompts):
    gen = BatchGenerator(tiny_target)
    greedy = gen.generate(prompts, 8, stops=set())
    assert gen.generate(prompts, 8, set(), temperature=1.0, top_p=1e-9,
                        generator=torch.Generator().manual_seed(0)) == greedy
    a = gen.generate(prompts, 8, set(), temperature=1.0, generator=torch.Generator().manual_seed(5))
    b = gen.generate(prompts, 8, set(), temperature=1.0, generator=torch.Generator().manual_seed(5))
    assert a == b and a != greedy  # a random model's distribution is flat: sampling departs from argmax


def drain(engine, prompts) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.submit(i, p)
    out = {}
    while not engine.idle():
        out.update(engine.step())
    return [out[i] for i in range(len(prompts))]


@pytest.mark.parametrize("slots", [1, 2, 3, 8])
def test_slots_greedy_equals_each_prompt_alone(tiny_target, prompts, slots):
    """Continuous batching: whatever the slot count and the order rows are refilled in, each row is the greedy
    decoding of its prompt alone; the rows stop at their own stop token or at max_new."""
    from eyas.models.generation import SlotGenerator

    free = [greedy_by_hand(tiny_target.model, p, 12, set()) for p in prompts]
    stop = free[1][3]
    want = [row[:row.index(stop) + 1] if stop in row else row for row in free]
    assert len({len(r) for r in want}) > 1  # rows end at different steps, so slots are refilled mid-run
    got = drain(SlotGenerator(tiny_target, slots, 12, {stop}), prompts)
    assert got == want


def test_slots_grow_the_cache_for_a_long_prompt(tiny_target, prompts):
    from eyas.models.generation import SlotGenerator

    g = torch.Generator().manual_seed(5)
    long = torch.randint(10, 40000, (300,), generator=g).tolist()  # past the first 256 columns
    engine = SlotGenerator(tiny_target, 2, 6, set())
    got = drain(engine, [prompts[0], long, prompts[3]])
    assert engine.cap >= 306
    assert got == [greedy_by_hand(tiny_target.model, p, 6, set()) for p in (prompts[0], long, prompts[3])]


def test_slots_reuse_a_conversations_previous_turn(tiny_target, prompts):
    """A key's next turn takes the slot that still holds its previous one: only the tokens after the common
    prefix are computed, and the reply is still the greedy decoding of the whole prompt alone."""
    from eyas.models.generation import SlotGenerator

    engine = SlotGenerator(tiny_target, 2, 8, set())
    a, b = object(), object()
    first = drain_keys(engine, [(a, prompts[3]), (b, prompts[1])])
    turn2 = prompts[3] + first[a] + [7, 8, 9]  # the reply, then the next user message
    other = prompts[1][:5] + [11, 12]  # b's prompt rewritten after 5 tokens: only those 5 are reusable
    again = drain_keys(engine, [(b, other), (a, turn2)])
    assert engine.reused == len(prompts[3]) + len(first[a]) - 1 + 5  # the reply's last token was never fed back
    assert again[a] == greedy_by_hand(tiny_target.model, turn2, 8, set())
    assert again[b] == greedy_by_hand(tiny_target.model, other, 8, set())


def drain_keys(engine, items) -> dict:
    for key, p in items:
        engine.submit(key, p)
    out = {}
    while not engine.idle():
        out.update(engine.step())
    return out


def test_slots_copy_a_prefix_another_slot_holds(tiny_target, prompts):
    """Prompts that start alike (a system prompt) take the shared columns from whichever slot holds them, busy or
    free; each reply is still the greedy decoding of its prompt alone."""
    from eyas.models.generation import SlotGenerator

    system = prompts[3][:20]
    items = [system + p for p in (prompts[0], prompts[1], prompts[4])]
    engine = SlotGenerator(tiny_target, 3, 6, set())
    engine.submit("a", items[0])
    engine.step()  # a is prefilled alone: nothing to share yet
    assert engine.reused == 0
    engine.submit("b", items[1])
    engine.submit("c", items[2])
    out = drain_keys(engine, [])
    assert engine.reused == 2 * len(system)  # b and c copied the system prompt from a's slot (a is still busy)
    assert out["b"] == greedy_by_hand(tiny_target.model, items[1], 6, set())
    assert out["c"] == greedy_by_hand(tiny_target.model, items[2], 6, set())


def test_width_chunks_cover_the_busy_rows_and_split_off_a_long_one():
    from eyas.models.generation import GROUP, width_chunks

    def cost(runs):
        return sum((hi - lo) * w + GROUP for lo, hi, w in runs)

    widths = [120] * 12 + [0, 0] + [1900] + [130] * 9 + [0] * 3
    runs = width_chunks(widths)
    rows = [r for lo, hi, _ in runs for r in range(lo, hi)]
    assert rows == sorted(set(rows)) and {r for r, w in enumerate(widths) if w} <= set(rows)  # each busy row once
    assert all(w >= max(widths[lo:hi]) for lo, hi, w in runs)  # a run attends over its widest row
    assert (12, 13) not in [(lo, hi) for lo, hi, _ in runs] and all(max(widths[lo:hi]) for lo, hi, _ in runs)
    assert any(w == 1900 and hi - lo <= 2 for lo, hi, w in runs)  # the long row (and at most a free one) alone
    assert cost(runs) < cost([(0, len(widths) - 3, 1900)])
    assert width_chunks([300] * 8) == [(0, 8, 300)]  # alike rows: one call
    assert width_chunks([0, 0]) == []
