"""The speculative decoding engine against independent references: transformers' own forward and `generate`,
brute-force tree ancestry, hand-made acceptance traces, and the target's distribution at temperature > 0."""

import copy
import dataclasses

import numpy as np
import pytest
import torch

from eyas.core.errors import EyasError
from eyas.models.llama import MKL_ROWS, mkl_unsupported, packing_unsupported
from eyas.speculate.controller import Controller, chain_yield, union_yield
from eyas.speculate.decode import (
    Proposal,
    acceptance_stats,
    first_divergence,
    plain_generate,
    speculative_generate,
    tree_mask,
    verify_greedy,
    verify_sampling,
)
from eyas.speculate.drafters import (
    Eagle3Drafter,
    HybridDrafter,
    OracleDrafter,
    PromptLookupDrafter,
    TreeShape,
    join_chains,
)
from eyas.speculate.quantize import quantize_int8
from eyas.speculate.suffix import SuffixDrafter, SuffixTrie
from eyas.speculate.target_forward import (
    HFRunner,
    LeanRunner,
    Projections,
    attention_mask,
    effective_latency,
    plan_from_times,
    verify_widths,
)
from tests.speculate_helpers import random_prompts, trained_draft, untrained_draft

NEW = 32


pytestmark = pytest.mark.usefixtures("one_thread")


def hf_greedy(target, prompt, n):
    """transformers' generate: the reference greedy continuation (no stop token: exactly n tokens)."""
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = target.model.generate(torch.tensor([prompt]), generation_config=gc)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def refs(tiny_target):
    prompts = random_prompts(16)[:4] + random_prompts(2, seed=5)  # 4 seen by the trained draft, 2 unseen
    return [(p, hf_greedy(tiny_target, p, NEW)) for p in prompts]


def random_parents(n, g):
    return torch.tensor([int(torch.randint(-1, j, (1,), generator=g)) if j else -1 for j in range(n)])


def test_tree_mask_is_ancestors_or_self():
    g = torch.Generator().manual_seed(0)
    for n in (1, 5, 12):
        parents = random_parents(n, g)
        m = tree_mask(parents)
        for i in range(n + 1):
            anc, node = {i}, i  # brute force: walk up to the root (node 0)
            while node:
                node = int(parents[node - 1]) + 1
                anc.add(node)
            assert set(torch.nonzero(m[i]).flatten().tolist()) == anc
    full = attention_mask(7, m, n + 1, "cpu")[0, 0]  # the runner adds the prefix, all visible
    assert full.shape == (n + 1, 7 + n + 1) and full[:, :7].all() and torch.equal(full[:, 7:], m)


def few_rows_runner(target, layers):
    return LeanRunner(target, layers, linear="few-rows")


PACKING = packing_unsupported(torch.float32, "cpu")


def packed_runner(target, layers):
    """Packed products from 3 rows on (a prefill, a tree), F.linear below: both kinds in one forward's history."""
    if PACKING:
        pytest.skip(PACKING)
    return LeanRunner(target, layers, linear=((1, "torch"), (3, "packed")))


MKL = mkl_unsupported(torch.float32, "cpu")


def mkl_runner(target, layers):
    """MKL's packed products from 3 rows on (each row count its own copy), F.linear below."""
    if MKL:
        pytest.skip(MKL)
    return LeanRunner(target, layers, linear=((1, "torch"), (3, "mkl")))


@pytest.mark.parametrize("impl", [LeanRunner, HFRunner, few_rows_runner, packed_runner, mkl_runner])
def test_runner_tree_forward_equals_plain_forward_of_each_path(tiny_target, impl):
    """Every node's logits and features equal transformers' plain forward over prefix + the node's path."""
    model, g = tiny_target.model, torch.Generator().manual_seed(1)
    runner = impl(tiny_target, tiny_target.default_feature_layers())
    prefix = torch.randint(0, 40000, (9,), generator=g)
    runner.prefill(prefix)
    parents = random_parents(6, g)
    tokens = torch.randint(0, 40000, (7,), generator=g)  # root + 6 nodes
    depth = [0] + Proposal(tokens[1:], parents).depths()
    logits, feats = runner.forward(tokens, 9 + torch.tensor(depth), tree_mask(parents))
    for i in range(7):
        path, node = [i], i
        while node:
            node = int(parents[node - 1]) + 1
            path.insert(0, node)
        out = model(torch.cat((prefix, tokens[path]))[None], output_hidden_states=True)
        torch.testing.assert_close(logits[i], out.logits[0, -1], rtol=1e-4, atol=1e-4)
        want = torch.cat([out.hidden_states[j][0, -1] for j in runner.feature_layers])
        torch.testing.assert_close(feats[i], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", [LeanRunner, HFRunner])
def test_runner_commit_keeps_the_accepted_path_only(tiny_target, impl):
    """After committing a tree path, the next token sees exactly prefix + path (rejected entries are gone)."""
    model, g = tiny_target.model, torch.Generator().manual_seed(2)
    runner = impl(tiny_target, tiny_target.default_feature_layers())
    prefix = torch.randint(0, 40000, (6,), generator=g)
    runner.prefill(prefix)
    parents = torch.tensor([-1, -1, 1, 0, 2])  # root -> {1, 2}, 2 -> 3 -> 5, 1 -> 4
    tokens = torch.randint(0, 40000, (6,), generator=g)
    runner.forward(tokens, 6 + torch.tensor([0, 1, 1, 2, 2, 3]), tree_mask(parents))
    runner.commit([0, 2, 3, 5])  # root, node 2 (index 2), its child 3, grandchild 5
    assert runner.length == 10
    nxt = torch.randint(0, 40000, (2,), generator=g)
    logits, _ = runner.forward(nxt)
    want = model(torch.cat((prefix, tokens[[0, 2, 3, 5]], nxt))[None]).logits[0, -2:]
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", [LeanRunner, HFRunner, few_rows_runner, packed_runner, mkl_runner])
def test_plain_generate_equals_transformers_generate(tiny_target, refs, impl):
    runner = impl(tiny_target, tiny_target.default_feature_layers())
    for prompt, ref in refs:
        assert plain_generate(runner, prompt, NEW).tokens == ref


@pytest.fixture(scope="module")
def shallow_target(tiny_target):
    """The tiny target's first three layers under its own embedding, norm and head: compiling unrolls every layer
    into the graph, and three compile in well under half the time of eight. Features from hidden states 1, 2, 3."""
    model = copy.deepcopy(tiny_target.model)
    model.model.layers = model.model.layers[:3]
    model.config.num_hidden_layers = 3
    return dataclasses.replace(tiny_target, model=model)


SHALLOW_LAYERS = [1, 2, 3]


@pytest.fixture(scope="module")
def compiled_runner(shallow_target):
    """One compiled lean runner for the module (torch.compile keeps its graphs by code and guards them on the
    runner, so each new runner would compile again), F.linear below 3 rows, packed products from 3 and MKL's from 6
    on where this CPU has them: every kind inside one graph. Its cache starts at the least capacity, to be grown."""
    plan = ((1, "torch"),) + ((3, "packed"),) * (not PACKING) + ((6, "mkl"),) * (not MKL)
    return LeanRunner(shallow_target, SHALLOW_LAYERS, capacity=1, linear=plan, compiled=True)


class CountingProjections(Projections):
    """The runner's plan, counting the rows of every product it computes."""

    def __init__(self, plan, packed):
        super().__init__(plan)
        self.packed, self.rows = packed, []

    def __call__(self, x, w, b=None):
        self.rows.append(x.numel() // x.shape[-1])
        return super().__call__(x, w, b)


def test_a_compiled_runner_computes_the_eager_rows_in_two_graphs_and_stays_lossless(shallow_target, tiny_target,
                                                                                    compiled_runner):
    """Its forwards after the prompt (one row, chains of 2 to 7 rows, a tree) run as exactly two graphs (fullgraph:
    a graph break raises), which call the runner's own projections (a new plan compiles nothing), grow the cache
    past its capacity, and return an eager runner's logits and features to rounding; greedy speculation with it, by
    the draft's chain and by suffix decoding, equals greedy decoding."""
    from torch._dynamo.utils import counters

    compiled = compiled_runner
    eager = LeanRunner(shallow_target, SHALLOW_LAYERS, linear=compiled.projections.plan)
    counting = CountingProjections(compiled.projections.plan, compiled.projections.packed)
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 40000, (240,), generator=g)  # the cache holds 256: the chains below grow it
    parents = random_parents(6, g)
    tree = (torch.randint(0, 40000, (7,), generator=g), 240 + torch.tensor([0] + Proposal(
        torch.zeros(6), parents).depths()), tree_mask(parents))
    graphs = counters["stats"]["unique_graphs"]
    for r in (eager, compiled):
        r.reset()
        r.prefill(prefix)
    compiled.projections = counting  # read at every product, not compiled in
    steps = [tree] + [(torch.randint(0, 40000, (q,), generator=g),) for q in (1, 4, 2, 7, 1, 3, 5, 1, 4)]
    for args in steps:
        (want, want_f), (got, got_f) = eager.forward(*args), compiled.forward(*args)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_f, want_f, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        for r in (eager, compiled):
            r.commit(list(range(len(args[0]) if len(args) == 1 else 1)))
    assert compiled.capacity > 256 and compiled.length == eager.length > 256
    assert counters["stats"]["unique_graphs"] - graphs == 2  # one row, and any other count
    per_forward = 4 * len(compiled.layers) + 1  # qkv, o, gate|up and down a layer, then the head
    assert counting.rows[:per_forward] == [7] * per_forward  # the tree's
    assert set(counting.rows) == {1, 2, 3, 4, 5, 7} and len(counting.rows) == len(steps) * per_forward
    compiled.projections = Projections(counting.plan)
    compiled.projections.packed = counting.packed
    # the draft's chain reads the compiled graph's features (trained for all eight layers, it is rejected here); the
    # oracle's chain and suffix decoding keep drafted tokens, so the cache commits rows past the first
    for kind in ("trained-chain", "oracle-chain", "suffix"):
        drafter, accepted = _drafter(kind, tiny_target), 0
        for prompt in random_prompts(16)[:4] + random_prompts(2, seed=5):
            ref = plain_generate(eager, prompt, NEW).tokens  # the eager runner equals transformers' generate above
            if kind == "oracle-chain":
                drafter.set_reference(ref)
            g = speculative_generate(compiled, drafter, prompt, NEW)
            assert g.tokens == ref, kind
            accepted += sum(r.accepted for r in g.rounds)
        assert accepted > 0 or kind == "trained-chain", kind
    assert counters["stats"]["unique_graphs"] - graphs == 2


def _drafter(kind, target):
    chain, tree = 4, TreeShape(topk=3, depth=4, size=10)
    if kind.startswith("oracle"):
        return OracleDrafter(chain, tree=kind.endswith("tree"), vocab=target.vocab_size)
    if kind == "prompt-lookup":
        return PromptLookupDrafter(chain)
    if kind == "suffix":
        return SuffixDrafter(chain, max_spec_factor=2.0)
    if kind == "hybrid-suffix":
        return HybridDrafter(Eagle3Drafter(trained_draft(target), k=chain), SuffixDrafter(chain))
    if kind.startswith("hybrid"):  # hybrid-adaptive: with a controller of its own, on costs where drafting pays;
        # hybrid-both: where verifying more tokens costs nothing, so both chains in one tree pay whenever lookup matches
        costs = {"adaptive": {1: 1.0, 2: 1.05, 5: 1.2}, "both": {1: 1.0, 16: 1.0}}.get(kind.split("-")[-1])
        ctl = Controller(costs, kmax=chain) if costs else None
        return HybridDrafter(Eagle3Drafter(trained_draft(target), k=chain), PromptLookupDrafter(chain), controller=ctl,
                             union=kind.endswith("both"))
    draft = trained_draft(target) if kind.startswith("trained") else untrained_draft(target)
    return Eagle3Drafter(draft, k=chain, tree=tree if kind.endswith("tree") else None)


KINDS = ["untrained-chain", "untrained-tree", "trained-chain", "trained-tree", "oracle-chain", "oracle-tree",
         "prompt-lookup", "suffix", "hybrid", "hybrid-adaptive", "hybrid-both", "hybrid-suffix"]


@pytest.mark.parametrize("kind", KINDS + ["few-rows:prompt-lookup", "few-rows:hybrid-adaptive", "few-rows:hybrid-both"])
def test_greedy_speculation_equals_greedy_decoding(tiny_target, refs, kind):
    linear, _, kind = kind.rpartition(":")
    runner = LeanRunner(tiny_target, tiny_target.default_feature_layers(), linear=linear or "torch")
    drafter = _drafter(kind, tiny_target)
    taus = []
    for prompt, ref in refs:
        if isinstance(drafter, OracleDrafter):
            drafter.set_reference(ref)
        g = speculative_generate(runner, drafter, prompt, NEW)
        assert g.tokens == ref, f"{kind}: diverges at token {first_divergence(ref, g.tokens)}"
        accepted = [r.accepted for r in g.rounds]
        taus.append(acceptance_stats(accepted, [r.depth for r in g.rounds])["tau"])
        if kind.startswith("oracle"):  # every round accepts all it proposed: 4 (the last one what was left)
            assert accepted[:-1] == [4] * (len(accepted) - 1) and sum(accepted) + len(accepted) >= NEW - 1
    if kind.startswith("oracle"):
        assert min(taus) >= 4.0  # k + 1 = 5 except the shorter last round (31 tokens in 7 rounds)
    if kind == "hybrid-both":  # rounds that verified the draft's chain and lookup's match as one tree
        assert drafter.used["both"] > 0, drafter.used
    if kind.startswith("trained") or kind.startswith("hybrid"):
        assert sum(taus[:4]) / 4 > 2.0, taus  # on the prompts it was trained on


def test_verify_widths_widen_only_where_a_wider_forward_measured_faster():
    # t(q) in ms as measured for SmolLM2-135M in fp32 on an AMD EPYC with AVX2 (2 threads, 2026-12-03)
    avx2 = {1: 69.0, 2: 107.9, 3: 136.4, 4: 90.0, 5: 102.9, 6: 102.2, 7: 136.8, 8: 108.2, 16: 147.0}
    assert verify_widths(avx2) == {2: 4, 3: 4, 7: 8}  # 5 -> 6 would save 0.7%: noise, not widened
    assert effective_latency(avx2, {2: 4, 3: 4, 7: 8}) == {**avx2, 2: 90.0, 3: 90.0, 7: 108.2}
    assert verify_widths({1: 10.0, 2: 11.0, 4: 12.0, 8: 15.0}) == {}  # t grows with q: nothing to gain
    assert verify_widths({1: 10.0, 2: 11.0, 3: 10.6}) == {}  # within 5%: measurement noise
    assert verify_widths({1: 10.0, 2: 11.0, 4: 10.0, 32: 5.0}) == {2: 4}  # never past twice the rows


@pytest.mark.parametrize("impl", [LeanRunner, HFRunner])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_widened_forward_returns_the_rows_of_the_narrow_one_and_commits_only_them(tiny_target, impl, dtype):
    """Chain and tree forwards widened by fillers: the real rows' logits and features are the q-row forward's
    (bit for bit in the lean runner's bf16, built to be row-invariant; to rounding otherwise), and after a commit
    the next forward sees the real tokens only."""
    from eyas.core.target import load_target

    target = tiny_target if dtype == "float32" else load_target("tiny", dtype=dtype)
    g = torch.Generator().manual_seed(3)
    prefix, tokens, nxt = (torch.randint(0, 40000, (n,), generator=g) for n in (9, 7, 3))
    parents = random_parents(6, g)
    tree = (9 + torch.tensor([0] + Proposal(tokens[1:], parents).depths()), tree_mask(parents))
    out = {}
    for widths in ({}, {7: 12, 3: 4}):
        runner = impl(target, target.default_feature_layers())
        runner.widths = widths
        rows, inner = [], runner._forward
        runner._forward = lambda ids, *a: rows.append(ids.shape[0]) or inner(ids, *a)
        runner.prefill(prefix)
        chain = runner.forward(tokens)
        runner.commit([0, 1, 2])
        after = runner.forward(nxt)
        runner.length = 9
        out[bool(widths)] = (*chain, *after, *runner.forward(tokens, *tree))
        assert runner.pending == 7 and chain[0].shape[0] == 7 and after[0].shape[0] == 3
        assert rows == ([9, 12, 4, 12] if widths else [9, 7, 3, 7])  # the prompt is never widened
    for narrow, wide in zip(out[False], out[True]):
        if dtype == "bfloat16" and impl is LeanRunner:
            assert torch.equal(narrow, wide)
        else:  # fp32; or HF's attention in bf16, whose fused kernel blocks by row count: a unit in the last place
            tol = 1e-5 if dtype == "float32" else 2 ** -7
            torch.testing.assert_close(wide, narrow, rtol=tol, atol=tol)


@pytest.mark.parametrize("impl", [LeanRunner, HFRunner])
@pytest.mark.parametrize("kind", ["trained-chain", "trained-tree", "prompt-lookup", "hybrid", "hybrid-both"])
def test_greedy_speculation_with_widened_verification_equals_greedy_decoding(tiny_target, refs, kind, impl):
    runner = impl(tiny_target, tiny_target.default_feature_layers())
    runner.widths = {q: q + 3 for q in range(2, 16)}  # every verification widened (tree paths gathered after it)
    drafter = _drafter(kind, tiny_target)
    for prompt, ref in refs:
        assert speculative_generate(runner, drafter, prompt, NEW).tokens == ref, kind


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_rows_do_not_depend_on_the_row_count(dtype):
    """The CPU attention of a verification: each of T query rows over a prefix of S keys and the T new ones
    (causal among them) equals, bit for bit, a one-row call over the keys that row sees, at prefixes on either
    side of the kernel's key blocks and every row count a round verifies; GQA heads as SmolLM2's. The float32
    path a GPU takes (_attend_fp32, run here on CPU tensors) computes the same attention, to rounding."""
    from eyas.speculate.target_forward import _attend, _attend_fp32, _rep_mask

    g = torch.Generator().manual_seed(5)
    nh, nkv, d = 9, 3, 64
    for prefix in (1, 37, 509, 600):
        for rows in (2, 3, 8, 16):
            n = prefix + rows
            q = torch.randn(1, nh, rows, d, generator=g).to(dtype)
            k, v = (torch.randn(1, nkv, n, d, generator=g).to(dtype).double() for _ in range(2))
            mask = attention_mask(prefix, None, rows, "cpu")
            out = _attend(q, k, v, mask)
            assert out.dtype == dtype
            gpu = _attend_fp32(q, k.to(dtype), v.to(dtype), _rep_mask(mask, nh // nkv))
            tol = 1e-5 if dtype == torch.float32 else 2 ** -7
            torch.testing.assert_close(gpu, out, rtol=tol, atol=tol)
            for t in range(rows):
                one = _attend(q[:, :, t:t + 1], k[:, :, :prefix + t + 1], v[:, :, :prefix + t + 1], None)
                assert torch.equal(out[:, :, t:t + 1], one), (prefix, rows, t)
    for n in (2, 37, 600):  # a prompt from the cache's start: the kernel's causal mask, the same rows
        q = torch.randn(1, nh, n, d, generator=g).to(dtype)
        k, v = (torch.randn(1, nkv, n, d, generator=g).to(dtype).double() for _ in range(2))
        assert torch.equal(_attend(q, k, v, None, causal=True), _attend(q, k, v, attention_mask(0, None, n, "cpu")))


def test_bf16_speculation_reproduces_bf16_greedy_decoding_bit_for_bit():
    """In bf16 a forward over q tokens must compute each row as a one-token step does
    (eyas.speculate.target_forward._attend), or near-tied logits flip and speculation drifts from plain decoding.
    Checked on the logits themselves."""
    import copy

    from eyas.core.target import load_target

    target = load_target("tiny", dtype="bfloat16")
    runner = LeanRunner(target, target.default_feature_layers())
    draft = copy.deepcopy(trained_draft(load_target("tiny"))).to(torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, 40000, (40,), generator=g)
    parents = torch.tensor([-1, -1, 0, 0, 2, 1, 4, -1, 6])
    toks = torch.randint(0, 40000, (10,), generator=g)
    runner.prefill(prefix)
    tree_logits, _ = runner.forward(toks, 40 + torch.tensor([0] + Proposal(toks[1:], parents).depths()),
                                    tree_mask(parents))
    for j in range(10):
        path, node = [j], j
        while node:
            node = int(parents[node - 1]) + 1
            path.insert(0, node)
        runner.length = 40
        for n in path:
            step, _ = runner.forward(toks[n:n + 1])
            runner.commit()
        assert torch.equal(step[0], tree_logits[j]), j
    drafters = {"chain": Eagle3Drafter(draft, k=5), "tree": Eagle3Drafter(draft, tree=TreeShape(3, 4, 10)),
                "int8 chain": Eagle3Drafter(quantize_int8(draft), k=5)}
    rounds = {name: [] for name in drafters}
    for prompt in random_prompts(16)[:3]:
        ref = plain_generate(runner, prompt, NEW).tokens
        for name, drafter in drafters.items():
            g = speculative_generate(runner, drafter, prompt, NEW)
            assert g.tokens == ref, name
            rounds[name] += g.rounds
    for name, rs in rounds.items():  # bf16 and int8 weights keep the trained draft useful
        assert acceptance_stats([r.accepted for r in rs], [r.depth for r in rs])["tau"] > 2.0, name


def test_a_stop_token_inside_an_accepted_draft_ends_generation(tiny_target, refs):
    runner = LeanRunner(tiny_target, tiny_target.default_feature_layers())
    prompt, ref = refs[1]
    i = next(j for j in range(6, NEW) if ref[j] not in ref[:j])
    stop = {ref[i]}
    assert plain_generate(runner, prompt, NEW, stop=stop).tokens == ref[: i + 1]
    drafter = OracleDrafter(4, vocab=tiny_target.vocab_size)
    drafter.set_reference(ref)
    g = speculative_generate(runner, drafter, prompt, NEW, stop=stop)
    assert g.tokens == ref[: i + 1] and len(g.rounds) == -(-i // 5)  # 5 tokens a round, no round after the stop


def test_adaptive_controller_stays_lossless_and_drafts_when_it_pays(tiny_target, refs):
    runner = LeanRunner(tiny_target, tiny_target.default_feature_layers())
    lat = {1: 1.0, 2: 1.05, 5: 1.2}  # seconds: the tiny draft costs next to nothing beside these
    for draft, want_drafted in ((trained_draft(tiny_target), True), (untrained_draft(tiny_target), False)):
        ctl = Controller(lat, kmax=4, learn=0.0)  # these prices, not the tiny target's (a draft's own cost)
        drafter = Eagle3Drafter(draft, k=4)
        rounds = []
        for prompt, ref in refs[:4]:
            g = speculative_generate(runner, drafter, prompt, NEW, controller=ctl)
            assert g.tokens == ref
            rounds += g.rounds
        share = sum(r.depth > 0 for r in rounds) / len(rounds)
        assert (share > 0.5) if want_drafted else (share < 0.35), share


def test_draft_tree_scores_equal_the_chain_along_each_path(tiny_target):
    """Tree attention inside the draft: each node's cumulative log-prob equals running the draft as a chain along
    that node's path (the draft's tree mask lets a node see its ancestors and the committed prefix only)."""
    draft = trained_draft(tiny_target)
    runner = LeanRunner(tiny_target, tiny_target.default_feature_layers())
    prompt = random_prompts(16)[3]
    logits, feats = runner.prefill(torch.tensor(prompt))
    seq = prompt + [int(logits[-1].argmax())]
    tree = Eagle3Drafter(draft, tree=TreeShape(topk=3, depth=4, size=12))
    tree.start(seq, feats)
    prop = tree.propose(seq, 0.0, None, None)
    assert len(prop) == 12 and max(prop.depths()) >= 3
    t2d = torch.full((tiny_target.vocab_size,), -1, dtype=torch.long)
    t2d[draft.target_ids()] = torch.arange(draft.cfg.draft_vocab_size)
    for j in range(len(prop)):
        path, node = [], j
        while node >= 0:
            path.insert(0, node)
            node = int(prop.parents[node])
        chain = Eagle3Drafter(draft, k=len(path))
        chain.start(seq, feats)  # the draft's prefill: the committed cache and the root's output
        h, logits = chain.ready
        total, cache, pos = 0.0, chain.cache, chain.done - 1
        for i, n in enumerate(path):
            tok = int(prop.tokens[n])
            total += float(torch.log_softmax(logits.float(), -1)[t2d[tok]])
            h, lg, cache = chain._forward(torch.tensor([[tok]]), h, torch.tensor([[pos + 1 + i]]), cache)
            logits = lg[0]
        assert abs(total - float(prop.scores[j])) < 1e-4, (j, path)


def test_verify_greedy_walks_the_matching_branch():
    # root -> a(1) b(2); b -> c(3) ; c -> d(4)
    tokens, parents = [10, 11, 12, 13], [-1, -1, 1, 2]
    # target after root wants 11 (b), after b wants 12 (c), after c wants 99 (not d)
    nxt = [11, 0, 12, 99, 0]
    assert verify_greedy(nxt, tokens, parents) == ([2, 3], 99)
    assert verify_greedy([5, 0, 0, 0, 0], tokens, parents) == ([], 5)


def _first_token_law(p, q_or_children, n, seed):
    """Empirical law of the first emitted token over n seeded rounds."""
    V = p.shape[1]
    counts = torch.zeros(V)
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        if isinstance(q_or_children, list):  # deterministic children of the root
            kids = q_or_children
            path, bonus = verify_sampling(p, kids, [-1] * len(kids), None, g)
            first = kids[path[0] - 1] if path else bonus
        elif isinstance(q_or_children, tuple):  # the hybrid's tree: a child drawn from q, prompt lookup's beside it
            q, lookup = q_or_children
            x = int(torch.multinomial(q, 1, generator=g))
            prop = join_chains(Proposal.chain([x], q[None]), lookup)  # one node where x is lookup's token
            tokens = prop.tokens.tolist()
            path, bonus = verify_sampling(p[: len(tokens) + 1], tokens, prop.parents.tolist(), prop.q, g)
            first = tokens[path[0] - 1] if path else bonus
        else:  # one child drawn from q (chain)
            x = int(torch.multinomial(q_or_children, 1, generator=g))
            path, bonus = verify_sampling(p, [x], [-1], q_or_children[None], g)
            first = x if path else bonus
        counts[first] += 1
    return counts / n


def test_join_chains_shares_the_common_prefix_and_keeps_each_tokens_law():
    q = torch.softmax(torch.randn(3, 12, generator=torch.Generator().manual_seed(0)), -1)
    chain = Proposal.chain([5, 6, 7], q)
    both = join_chains(chain, [5, 6, 9, 10])  # agrees on 5 6, then branches under 6
    assert both.tokens.tolist() == [5, 6, 7, 9, 10] and both.parents.tolist() == [-1, 0, 1, 1, 3]
    assert torch.equal(both.q[:3], q) and both.q[3].tolist() == [float(i == 9) for i in range(12)]
    assert both.q[4].argmax() == 10 and both.q[4].sum() == 1  # point masses: one-hot rows
    assert join_chains(chain, [8]).parents.tolist() == [-1, 0, 1, -1]  # disagrees at once: a second root child
    assert join_chains(chain, [5, 6]) is chain  # a prefix of the chain adds nothing
    assert join_chains(Proposal.chain([5, 6]), [5, 8]).q is None  # greedy: no laws
    path, bonus = verify_greedy([5, 6, 9, 0, 10, 11], *(x.tolist() for x in (both.tokens, both.parents)))
    assert [both.tokens[j - 1].item() for j in path] == [5, 6, 9, 10] and bonus == 11  # the lookup branch won


def test_union_yield_of_one_chain_is_its_chain_yield_and_of_two_reaches_the_likelier_depth():
    assert union_yield([((3.0, 1.0), 4)]) == pytest.approx(chain_yield(3.0, 1.0, 4))
    # alphas 0.5 (k=2) and 0.8 (m=1): reach 1 w.p. 1 - 0.5 * 0.2 = 0.9, reach 2 w.p. 0.25
    assert union_yield([((1.0, 1.0), 2), ((4.0, 1.0), 1)]) == pytest.approx(1 + 0.9 + 0.25)
    both = union_yield([((1.0, 1.0), 3), ((1.0, 1.0), 3)])
    assert chain_yield(1.0, 1.0, 3) < both < 2 * chain_yield(1.0, 1.0, 3) - 1


@pytest.mark.parametrize("case", ["chain", "tree", "chain+lookup"])
def test_speculative_sampling_keeps_the_target_distribution(case):
    p0 = torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05])
    q0 = torch.tensor([0.05, 0.10, 0.15, 0.30, 0.40])  # a poor draft: mass where the target has little
    p = torch.stack([p0, torch.full((5,), 0.2), torch.full((5,), 0.2), torch.full((5,), 0.2)])  # rows after each node
    n = 20000
    drafts = {"chain": q0, "tree": [4, 0, 3], "chain+lookup": (q0, [3, 2])}  # lookup's 3 is often drafted too
    law = _first_token_law(p, drafts[case], n, seed=3)
    bound = 5 * torch.sqrt(p0 * (1 - p0) / n)  # 5 sigma per token
    assert ((law - p0).abs() < bound).all(), (law, p0)
    # and the draft's own law would have failed the same bound
    assert ((q0 - p0).abs() > bound).any()


def test_acceptance_stats_on_hand_traces():
    s = acceptance_stats(accepted=[0, 2, 3, 0], depth=[3, 3, 3, 0])
    assert s["rounds"] == 4 and s["drafted_rounds"] == 3
    assert s["tau"] == (5 + 4) / 4 and s["tau_drafted"] == (5 + 3) / 3
    assert s["tau_hist"] == {"1": 2, "3": 1, "4": 1}
    assert s["accept_rate_by_position"] == [2 / 3, 2 / 2, 1 / 2]
    assert s["reach_by_position"] == [2 / 3, 2 / 3, 1 / 3]
    s = acceptance_stats(accepted=[1, 1, 0], depth=[1, 3, 2])  # shorter proposals do not count at deeper positions
    assert s["accept_rate_by_position"] == [2 / 3, 0 / 1, None]
    assert acceptance_stats([], [])["tau"] is None


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    d = PromptLookupDrafter(k=3, ngram=3)
    assert d.propose([1, 2, 3, 9, 8, 7, 6, 5, 1, 2, 3], 0.0, None, None).tokens.tolist() == [9, 8, 7]
    assert d.propose([4, 5, 1, 2, 7, 7, 1, 2, 9, 1, 2], 0.0, None, None).tokens.tolist() == [9, 1, 2]  # latest
    assert d.propose([1, 2, 3, 4], 0.0, None, None).tokens.tolist() == []
    assert d.propose([5, 6, 5], 0.0, None, 1).tokens.tolist() == [6]  # unigram fallback, budget 1


def test_a_suffix_trie_counts_every_substring_up_to_its_depth():
    t = SuffixTrie(depth=3)
    t.add([1, 2, 3, 1, 2, 4])
    assert {tok: n.count for tok, n in t.root.children.items()} == {1: 2, 2: 2, 3: 1, 4: 1}
    node = t.root.children[1].children[2]  # "1 2": twice, followed once by 3 and once by 4
    assert node.count == 2 and {tok: n.count for tok, n in node.children.items()} == {3: 1, 4: 1}
    assert node.children[3].children == {}  # depth 3: "1 2 3" is as deep as it goes
    assert t.follow(t.follow([], 2), 3) == [t.root.children[3], t.root.children[2].children[3]]
    assert t.follow([t.root.children[1]], 9) == []  # "9" never occurred: nor any suffix ending in it


def test_suffix_drafting_follows_the_longest_match_and_grows_with_it():
    d = SuffixDrafter(k=8)  # at most 1 x the match length
    d.start([5, 1, 2, 3, 9, 1, 2], None)
    assert d.propose([5, 1, 2, 3, 9, 1, 2], 0.0, None, None).tokens.tolist() == [3, 9]  # "1 2" -> 3 9
    seq = [5, 1, 2, 3, 9, 1, 2, 3]  # "1 2 3" matched: 3 tokens
    assert d.propose(seq, 0.0, None, None).tokens.tolist() == [9, 1, 2]
    assert d.propose(seq, 0.0, None, 2).tokens.tolist() == [9, 1]  # the round's budget
    assert d.propose([5, 1, 2, 3, 9, 1, 2, 3, 7], 0.0, None, None).tokens.tolist() == []  # 7 never continued


def test_suffix_drafting_grows_a_tree_best_first_by_frequency():
    d = SuffixDrafter(k=4, max_spec_factor=2.0, min_prob=0.2)
    seq = [1, 2, 3, 8, 1, 2, 3, 8, 1, 2, 4, 1, 2]  # "4 1 2" never continued; "1 2" by 3, 3, 4
    d.start(seq, None)
    tokens, parents, expected, n = d.tree(seq, 8)  # budget 2 x the match of 2 = 4 tokens
    assert n == 2 and tokens == [3, 8, 1, 2] and parents == [-1, 0, 1, 2]  # 2/3 each, above 4's 1/3
    assert expected == pytest.approx(4 * 2 / 3)
    d = SuffixDrafter(k=4, max_spec_factor=2.0, min_prob=0.2)
    seq = [1, 2, 3, 8, 5, 1, 2, 3, 8, 6, 1, 2, 4, 7, 1, 2]  # after "1 2 3 8": 5 once, 6 once
    d.start(seq, None)
    tokens, parents, expected, n = d.tree(seq, 4)
    # 3 (2/3), 8 (2/3), then three of 1/3: 4 (under the root, found first), 5 (under 8); 6 and 7 left out
    assert n == 2 and tokens == [3, 8, 4, 5] and parents == [-1, 0, -1, 1]
    assert expected == pytest.approx(2 / 3 + 2 / 3 + 1 / 3 + 1 / 3)
    assert d.match(seq, 4) == ([3, 8, 5], 2)  # the hybrid's chain: the tree's first path (the likeliest)


def test_suffix_drafting_verifies_the_match_length_whose_tree_expects_most():
    """The longest match is not always the best: "1 2" was followed by three different tokens (1/3 each), while "2"
    was followed by 7 nine times in twelve. The one token after "2" expects 0.75 accepted, the two best after
    "1 2" 2/3: the shorter match's tree is verified (taking the longest match lost 9% of tau on MT-Bench)."""
    seq = [1, 2, 11, 1, 2, 12, 1, 2, 13] + [5, 2, 7] * 9 + [1, 2]
    d = SuffixDrafter(k=8)
    d.start(seq, None)
    tokens, parents, expected, n = d.tree(seq, 8)
    assert (tokens, parents, n) == ([7], [-1], 1) and expected == pytest.approx(9 / 12)
    assert d.propose(seq, 0.0, None, None).tokens.tolist() == [7]
    d = SuffixDrafter(k=8)  # with "2 7" seen less often than 2/3 of the time, the longer match's tree wins again
    seq = [1, 2, 11, 1, 2, 12, 1, 2, 13] + [5, 2, 7] * 5 + [1, 2]
    d.start(seq, None)
    tokens, parents, expected, n = d.tree(seq, 8)
    assert n == 2 and tokens[:2] == [11, 12] and expected == pytest.approx(2 / 3)


def test_suffix_drafting_learns_from_the_runs_earlier_replies():
    d = SuffixDrafter(k=8)
    d.start([40, 41, 7], None)  # first request: prompt 40 41, reply 7 8 9 10 11
    d.propose([40, 41, 7, 8, 9, 10, 11], 0.0, None, None)
    d.start([50, 7, 8], None)  # the next request: its own text has no "7 8" before; the first reply had
    assert d.propose([50, 7, 8], 0.0, None, None).tokens.tolist() == [9, 10]
    d.forget()  # (after evaluate's warm-up): the run has seen nothing
    d.start([50, 7, 8], None)
    assert d.propose([50, 7, 8], 0.0, None, None).tokens.tolist() == []
    d.start([40, 41, 7], None)
    d.update([40, 41, 7, 8, 9, 10, 11], None)  # the reply's last round, never proposed from, joins the run's trie
    d.start([50, 7, 8], None)
    assert d.propose([50, 7, 8], 0.0, None, None).tokens.tolist() == [9, 10]


def test_replaying_a_model_free_drafter_counts_the_rounds_of_the_decoding_loop(tiny_target):
    """bench/replay_drafters.py counts evaluate's rounds without the target (at temperature 0 a round keeps what the
    target's greedy continuation confirms). Against the decoding loop itself, for prompt lookup and suffix decoding
    over a run of requests (suffix decoding's run-wide trie carrying from one to the next): the same accepted
    tokens, round by round."""
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "replay_drafters", Path(__file__).resolve().parents[1] / "bench" / "replay_drafters.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # (its dataclass looks its module up)
    spec.loader.exec_module(bench)
    runner = LeanRunner(tiny_target, tiny_target.default_feature_layers())
    prompts = [p * 3 for p in random_prompts(4, length=6)]  # repeated text: something for lookup to find
    rows = [{"id": i, "prompt": p, "reply": plain_generate(runner, p, NEW + 10).tokens, "max_new": NEW}
            for i, p in enumerate(prompts)]
    for make in (lambda: PromptLookupDrafter(4), lambda: SuffixDrafter(8)):
        looped = make()
        accepted = [r.accepted for p in prompts for r in speculative_generate(runner, looped, p, NEW).rounds]
        replayed = bench.replay({"stop": [], "rows": rows}, bench.EyasDrafter(make()))
        assert replayed["accepted"] == accepted and sum(accepted) > 0
        assert replayed["tau"] == pytest.approx(acceptance_stats(accepted, [1] * len(accepted))["tau"])


class StubDraft:
    """A hybrid's draft side where only its start() is used."""

    k, forward_time, forward_calls = 3, 0.0, 0

    def start(self, seq, feats):
        pass


def test_a_repeated_request_starts_from_the_state_the_first_started_from():
    """evaluate --repeats decodes a turn several times and keeps the fastest: each repeat must draft as the first
    did. Without `repeat`, suffix decoding drafted the repeat's reply from the first decode's; the hybrid also
    carried the first decode's acceptance counts and rounds into the repeat."""
    d = SuffixDrafter(k=8)
    d.start([40, 41, 7], None)
    d.propose([40, 41, 7, 8, 9, 10, 11], 0.0, None, None)  # request A: reply 7 8 9 10 11
    d.start([50, 60, 20], None)
    assert d.propose([50, 60, 20, 21, 22, 23], 0.0, None, None).tokens.tolist() == []  # B: reply 20 21 22 23
    leaky = copy.deepcopy(d)
    leaky.start([50, 60, 20], None)  # B again, as a new request: B's first reply is drafted from
    assert leaky.propose([50, 60, 20], 0.0, None, None).tokens.tolist() == [21]
    d.repeat()
    d.start([50, 60, 20], None)  # B again, as a repeat: only A's reply is known, as at B's first start
    assert d.propose([50, 60, 20], 0.0, None, None).tokens.tolist() == []
    d.propose([50, 60, 20, 21, 22, 23], 0.0, None, None)
    d.start([70, 20], None)  # the next request learns from B's reply once
    tokens, _, _, n = d.tree([70, 20], 8)
    assert tokens == [21] and n == 1 and d.shared.root.children[21].count == 1

    hybrid = HybridDrafter(StubDraft(), SuffixDrafter(k=8))
    hybrid.start([40, 41, 7], None)
    before = copy.deepcopy(hybrid.stats)
    hybrid.stats["eagle3"] = [9.0, 0.5]
    hybrid.used["eagle3"] += 4  # what a decode of the request learned and did
    hybrid.repeat()
    assert hybrid.stats == before and hybrid.used["eagle3"] == 0
    hybrid.stats["eagle3"] = [9.0, 0.5]
    hybrid.forget()  # after the warm-up: the priors again
    assert hybrid.stats == before


def test_the_hybrid_starts_its_partner_at_every_request():
    """A new request restarts suffix decoding's request trie inside the hybrid too, and the earlier reply joins its
    run-wide trie (the hybrid used to start only the draft, so its partner read the next prompt as a continuation)."""

    hybrid = HybridDrafter(StubDraft(), SuffixDrafter(k=8))
    hybrid.start([40, 41, 7], None)
    hybrid.lookup.match([40, 41, 7, 8, 9, 10, 11], 8)
    hybrid.start([50, 7, 8], None)
    assert hybrid.lookup.match([50, 7, 8], 8) == ([9, 10], 2)


def test_controller_picks_plain_for_a_poor_draft_and_long_chains_for_a_good_one():
    from eyas.speculate.decode import Round

    lat = {1: 0.060, 2: 0.060, 4: 0.061, 8: 0.066, 16: 0.084}
    poor, good = Controller(lat, kmax=7), Controller(lat, kmax=7)
    picks = []
    for _ in range(200):
        k = poor.choose()
        picks.append(k)
        poor.observe(Round(k, k, 0, 0.0, 0.06, 0.002 * k, k))
        kg = good.choose()
        good.observe(Round(kg, kg, kg, 0.0, 0.06, 0.002 * kg, kg))
    drafted = [k for k in picks[20:] if k]
    assert drafted and all(k == 1 for k in drafted)  # one-token probes only
    extra = sum(poor.t(k + 1) + 0.002 * k - poor.t(1) for k in picks[20:]) / (180 * poor.t(1))
    assert extra <= 0.025  # the probes cost at most ~2% of plain decoding's time
    assert good.choose() == 7


def test_controller_learns_the_target_latency_from_its_rounds_and_chooses_by_it():
    """A start-up table measured in a slow spell (t(1) 25% high, wider forwards 2x) prices drafting out; the rounds'
    own target forwards correct it, and the choice follows the corrected prices."""
    import random

    from eyas.speculate.decode import Round

    true = {1: 0.040, 2: 0.041, 4: 0.043, 8: 0.048}
    slow = {1: 0.050, 2: 0.080, 4: 0.090, 8: 0.100}
    step = 0.002

    def run(ctl, rounds=400):
        rng, picks = random.Random(0), []
        for _ in range(rounds):
            k = ctl.choose()
            picks.append(k)
            kept = 0
            while kept < k and rng.random() < 0.5:  # each drafted token accepted with probability 1/2
                kept += 1
            t = float(np.interp(k + 1, list(true), list(true.values())))
            ctl.observe(Round(k, k, kept, 0.0, t, step * k, k))
        return picks

    # alpha = 1/2: a chain of 3 makes 1.875 tokens a round. At the true prices it pays, 1.875 / (t(4) + 3 step) =
    # 38 tokens/s against plain 1 / t(1) = 25; at the slow table's no chain does (at most 19.5 against 20).
    fixed, learning = Controller(slow, kmax=7, learn=0.0), Controller(slow, kmax=7)
    assert run(fixed)[-100:].count(0) > 90
    assert fixed.latency() == slow
    late = run(learning)[-100:]
    assert late.count(0) < 5, late
    k = max(set(late), key=late.count)  # the chain it settled on: its price is learned (an unchosen one may lag)
    assert learning.t(k + 1) == pytest.approx(np.interp(k + 1, list(true), list(true.values())), rel=0.05)


def test_controller_prices_of_untried_sizes_follow_the_machine_and_do_not_wander():
    """Rounds verifying 2 and 8 tokens, timed with noise, on a machine 20% slower than at start-up: t(1), never
    verified, follows the machine's level (not a random walk fed by the noise of the other sizes)."""
    import random

    table = {1: 0.040, 2: 0.041, 4: 0.043, 8: 0.048}
    ctl, rng = Controller(table, kmax=7), random.Random(1)
    for i in range(3000):
        q = 2 if i % 2 else 8
        ctl.learn_latency(q, 1.2 * table[q] * rng.uniform(0.7, 1.3))
    assert ctl.t(1) == pytest.approx(1.2 * 0.040, rel=0.08)
    assert ctl.t(2) == pytest.approx(1.2 * 0.041, rel=0.08) and ctl.t(8) == pytest.approx(1.2 * 0.048, rel=0.08)


def test_a_hybrid_learns_its_prices_once_a_round_from_the_decoder(tiny_target, refs):
    """The decoder hands every round's target seconds to the drafter (`timed`); a hybrid with its own controller
    learns its prices from each round once, and nothing from the rounds it reports for acceptance only."""
    runner = LeanRunner(tiny_target, tiny_target.default_feature_layers())
    ctl = Controller({1: 1.0, 4: 1.1, 8: 1.2}, kmax=3)
    seen = []
    learn = ctl.learn_latency
    ctl.learn_latency = lambda q, s: (seen.append((q, s)), learn(q, s))[1]
    hybrid = HybridDrafter(Eagle3Drafter(trained_draft(tiny_target), k=3), PromptLookupDrafter(4), controller=ctl)
    prompt, ref = refs[0]
    g = speculative_generate(runner, hybrid, prompt, NEW, controller=None)
    assert g.tokens == ref
    assert [(q, s) for q, s in seen if s > 0] == [(r.size + 1, r.target_s) for r in g.rounds]
    assert ctl.scale < 0.8 and ctl.t(1) < 0.8  # moving to the tiny target's millisecond forwards from the 1 s table


def test_controller_rounds_beyond_its_table_move_the_scale_only():
    ctl = Controller({1: 0.040, 8: 0.048}, kmax=7)
    ctl.learn_latency(16, 0.080)  # beyond the table: 0.080 / 0.048 = 1.67x the last point's price
    assert ctl.rho == {} and ctl.scale == pytest.approx((0.080 / 0.048) ** 0.1)
    before = ctl.t(8)  # the last point followed the scale up
    ctl.learn_latency(8, 0.048)  # a round at the point itself moves it back toward its measurement
    assert 0.048 < ctl.t(8) < before and ctl.t(1) == pytest.approx(0.040 * ctl.scale)


def test_controller_latency_learning_shrugs_off_one_descheduled_forward():
    from eyas.speculate.decode import Round

    lat = {1: 0.040, 8: 0.048}
    ctl = Controller(lat, kmax=7)
    ctl.observe(Round(0, 0, 0, 0.0, 4.0, 0.0, 0))  # a forward 100x its usual time
    assert ctl.t(1) == pytest.approx(0.040 * 2 ** 0.1)  # counted as twice its price, at weight 0.1
    for _ in range(30):
        ctl.observe(Round(0, 0, 0, 0.0, 0.040, 0.0, 0))
    assert ctl.t(1) == pytest.approx(0.040, rel=0.01)


def _started(target, drafter, prompt):
    runner = LeanRunner(target, target.default_feature_layers())
    with torch.inference_mode():
        logits, feats = runner.prefill(torch.tensor(prompt))
        seq = list(prompt) + [int(logits[-1].argmax())]
        drafter.start(seq, feats)
    return seq, feats


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_hybrid_proposes_the_drafter_expected_to_yield_more_with_its_own_law(tiny_target, temperature):
    """Per round the hybrid verifies one drafter's proposal as that drafter made it (prompt lookup's tokens as a
    point mass, EAGLE-3's with the law it sampled them from), chosen by the expected accepted length."""
    draft = trained_draft(tiny_target)
    prompt = random_prompts(1, seed=7)[0]
    lookup = PromptLookupDrafter(4)
    hybrid = HybridDrafter(Eagle3Drafter(draft, k=3), lookup)
    seq, _ = _started(tiny_target, hybrid, prompt)
    seq = seq + prompt[:3]  # ends as the prompt began: prompt lookup proposes what followed there
    gen = torch.Generator().manual_seed(0)
    assert lookup.match(seq, 4)[1] == 3  # a 3-token match
    hybrid.stats.update({"eagle3": [1.0, 20.0], "prompt-lookup/3": [20.0, 1.0]})  # lookup accepted, the draft not
    calls = hybrid.forward_calls
    with torch.inference_mode():
        got = hybrid.propose(seq, temperature, gen, None)
    want = lookup.propose(seq, temperature, gen, None)
    assert len(want) and got.tokens.tolist() == want.tokens.tolist() and got.q is None
    assert hybrid.forward_calls == calls and hybrid.used == {"eagle3": 0, "prompt-lookup": 1}  # no draft forward
    hybrid.update(seq + got.tokens.tolist()[:2] + [5], None)  # 2 of its 4 accepted, then the target's token
    assert hybrid.stats["prompt-lookup/3"] == [0.9 * 20 + 2, 0.9 * 1 + 1]  # its match length's counts only
    assert hybrid.stats["prompt-lookup/1"] == hybrid.stats["prompt-lookup/2"] == [1.0, 1.0]

    alone = Eagle3Drafter(draft, k=3)
    seq, _ = _started(tiny_target, hybrid, prompt)
    _started(tiny_target, alone, prompt)
    hybrid.stats.update({"eagle3": [20.0, 1.0], "prompt-lookup/3": [1.0, 20.0]})
    with torch.inference_mode():
        got = hybrid.propose(seq, temperature, torch.Generator().manual_seed(1), None)
        want = alone.propose(seq, temperature, torch.Generator().manual_seed(1), None)
    assert got.tokens.tolist() == want.tokens.tolist() and hybrid.forward_calls > calls
    assert (got.q is None) == (temperature == 0) and (got.q is None or torch.equal(got.q, want.q))


def test_an_adaptive_hybrid_tries_free_prompt_lookup_where_the_draft_does_not_pay(tiny_target):
    """With a controller that has stopped drafting (the draft's rounds were rejected), the hybrid still verifies
    prompt lookup's match where its expected tokens pay for the longer verification, decodes plainly where they
    do not, and the controller learns from the draft's rounds only."""
    from eyas.speculate.decode import Round

    lat = {1: 0.060, 2: 0.060, 4: 0.061, 8: 0.066}
    ctl = Controller(lat, kmax=3)
    for _ in range(30):  # a draft whose every token was rejected: the controller decodes plainly
        ctl.choose()
        ctl.observe(Round(3, 3, 0, 0.0, 0.06, 0.01, 3))
    assert ctl.choose() == 0
    prompt = random_prompts(1, seed=7)[0]
    lookup = PromptLookupDrafter(4)
    hybrid = HybridDrafter(Eagle3Drafter(trained_draft(tiny_target), k=3), lookup, controller=ctl)
    seq, _ = _started(tiny_target, hybrid, prompt)
    seq = seq + prompt[:3]  # prompt lookup finds a 3-token match
    hybrid.stats["prompt-lookup/3"] = [30.0, 1.0]  # and such matches have been accepted
    calls, state = hybrid.forward_calls, (ctl.A, ctl.R)
    with torch.inference_mode():
        got = hybrid.propose(seq, 0.0, None, None)
    assert got.tokens.tolist() == lookup.propose(seq, 0.0, None, None).tokens.tolist() != []
    assert hybrid.forward_calls == calls and hybrid.used == {"eagle3": 0, "prompt-lookup": 1}
    hybrid.update(seq + got.tokens.tolist() + [5], None)  # all 4 accepted, then the target's token
    assert (ctl.A, ctl.R) == state  # prompt lookup's round taught the draft's controller nothing
    assert hybrid.stats["prompt-lookup/3"] == [0.9 * 30 + 4, 0.9 * 1]
    hybrid.stats["prompt-lookup/3"] = [1.0, 30.0]  # now such matches are rejected: plain decoding pays more
    ctl.idle = -10**6  # no probe round of the draft now
    with torch.inference_mode():
        assert hybrid.propose(seq, 0.0, None, None).tokens.tolist() == []


@pytest.mark.parametrize("runner_kind", ["lean", "hf"])
def test_decode_time_chain_equals_training_time_predictions(tiny_target, runner_kind):
    """The draft predicts at decode time what training taught it on the same sequence: the features the decoder
    feeds it equal what extraction stores, and each token of an EAGLE-3 chain drafted after a prompt is the
    training-time top-1 of that TTT step at the prompt's last position, when the sequence continues with the
    chain (as an accepted chain does). Training accuracy and acceptance measure the same predictions."""
    from eyas.draft.ttt import ttt_forward
    from eyas.models.capture import Capture, forward_batch

    k = 5
    draft = trained_draft(tiny_target)
    layers = tiny_target.default_feature_layers()
    runner = (LeanRunner if runner_kind == "lean" else HFRunner)(tiny_target, layers)
    prompt = random_prompts(16)[2]
    drafter = Eagle3Drafter(draft, k=k)
    seen = []  # the draft's logits at each decode-time forward: the catch-up's last row, then each chain step's
    forward = drafter._forward

    def recording(*args, **kw):
        h, lg, cache = forward(*args, **kw)
        seen.append(torch.log_softmax(lg[-1].float(), -1))
        return h, lg, cache

    drafter._forward = recording
    with torch.inference_mode():
        logits, feats = runner.prefill(torch.tensor(prompt))
        seq = list(prompt) + [int(logits[-1].argmax())]
        drafter.start(seq, feats)
        chain = drafter.propose(seq, 0.0, None, None).tokens.tolist()
    assert len(seen) == k  # one catch-up, k - 1 chain steps
    full = seq + chain  # the sequence training would see if the chain were the data
    with Capture(tiny_target, layers) as cap:
        stored = forward_batch(tiny_target, cap, [torch.tensor(full)])  # [aux0, aux1, aux2, final], [1,T,H]
    aux = torch.cat(stored[:3], dim=-1)  # [1,T,3H]
    torch.testing.assert_close(aux[0, :len(prompt)], feats.float(), rtol=1e-5, atol=1e-5)

    t, T = len(prompt) - 1, len(full)
    d_ids = {int(g): i for i, g in enumerate(draft.target_ids())}
    ids = torch.tensor([full])
    for i in range(k):  # step i at position t predicts full[t+2+i] = chain[i] (step 0: after seq's last token)
        logp = torch.full((1, T, draft.cfg.draft_vocab_size), -1e4)
        logp[0, t + 1 + i, d_ids[chain[i]]] = 0.0  # the "target" says: the chain's own token
        mask = torch.zeros(1, T, dtype=torch.long)
        mask[0, t + 2 + i] = 1
        with torch.no_grad():
            r = ttt_forward(draft, ids, aux, logp, mask, steps=i + 1)
        assert int(r.count[i]) == 1 and int(r.correct[i]) == 1, f"step {i}: training's top-1 is not chain[{i}]"
        # and the same distribution: training's loss against a one-hot target is decode time's -log q(chain[i])
        torch.testing.assert_close(r.loss_sum[i], -seen[i][d_ids[chain[i]]], rtol=1e-4, atol=1e-4)


def test_a_chain_waits_for_the_device_once_a_proposal_whatever_its_length(tiny_target, monkeypatch):
    """A chain's tokens stay on the device until all k are drafted: no value is read back per step (int(argmax)
    would wait for a GPU k times a round), and the timing syncs bracket the whole proposal."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import eyas.speculate.drafters as drafters

    class Reads(TorchDispatchMode):  # ops that copy a device value to the host (item, int, bool, nonzero)
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
                Reads.n += 1
            return func(*args, **(kwargs or {}))

    syncs = []
    monkeypatch.setattr(drafters, "sync", lambda dev: syncs.append(dev))
    runner = LeanRunner(tiny_target, tiny_target.default_feature_layers())
    prompt = random_prompts(16)[2]
    counts = {}
    for k in (2, 6):
        logits, feats = runner.prefill(torch.tensor(prompt))
        seq = prompt + [int(logits[-1].argmax())]
        drafter = Eagle3Drafter(trained_draft(tiny_target), k=k)
        drafter.start(seq, feats)
        syncs.clear()
        Reads.n = 0
        with Reads():
            prop = drafter.propose(seq, 0.0, None, None)
        assert len(prop) == k
        counts[k] = (len(syncs), Reads.n)
    assert counts[2] == counts[6] and counts[6][0] == 2 and counts[6][1] == 0, counts


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 16, 17])
def test_few_rows_linear_is_the_same_product_as_f_linear(rows):
    """(W @ x.T).T, one row doubled: the same numbers as F.linear up to the order of the sums, any leading shape
    (one vector, rows, batches of rows, a strided view), with or without a bias; more than FEW_ROWS rows go to
    F.linear itself."""
    import torch.nn.functional as F

    from eyas.models.llama import FEW_ROWS, few_rows_linear

    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    shaped = [torch.randn(1, rows, 40, generator=g), torch.randn(rows, 40, generator=g),
              torch.randn(40, rows, generator=g).T]  # a transposed view: not contiguous
    if rows % 2 == 0:
        shaped.append(torch.randn(2, rows // 2, 40, generator=g))
    if rows == 1:
        shaped.append(torch.randn(40, generator=g))
    for x in shaped:
        for bias in (None, b):
            got, want = few_rows_linear(x, w, bias), F.linear(x, w, bias)
            assert got.shape == want.shape == (*x.shape[:-1], 96)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            if rows > FEW_ROWS:
                assert torch.equal(got, want)


@pytest.mark.skipif(bool(PACKING), reason=PACKING or "")
@pytest.mark.parametrize("rows", [1, 3, 4, 16, 40])
def test_packed_linear_is_the_same_product_as_f_linear(rows):
    """oneDNN over a weight packed once: F.linear's numbers up to the order of the sums, any leading shape and
    layout, with or without a bias, in float32 and (where the CPU has it) bfloat16."""
    import torch.nn.functional as F

    from eyas.models.llama import pack_weight, packed_linear

    g = torch.Generator().manual_seed(rows)
    for dtype in (torch.float32, torch.bfloat16):
        if packing_unsupported(dtype, "cpu"):
            continue
        w, b = torch.randn(96, 40, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
        packed = pack_weight(w)
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
        for x in (torch.randn(1, rows, 40, generator=g), torch.randn(40, rows, generator=g).T):
            x = x.to(dtype)
            for bias in (None, b):
                got, want = packed_linear(x, packed, bias), F.linear(x, w, bias)
                assert got.shape == want.shape == (*x.shape[:-1], 96) and got.dtype == dtype
                torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.skipif(bool(MKL), reason=MKL or "")
@pytest.mark.parametrize("rows", [1, 3, 4, 16])
def test_mkl_linear_is_the_same_product_as_f_linear(rows):
    """MKL over a weight packed for the row count: F.linear's numbers to float32's rounding, any leading shape
    and layout, with or without a bias."""
    import torch.nn.functional as F

    from eyas.models.llama import mkl_linear, mkl_pack

    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    packed = mkl_pack(w, rows)
    for x in (torch.randn(1, rows, 40, generator=g), torch.randn(40, rows, generator=g).T):
        for bias in (None, b):
            got, want = mkl_linear(x, packed, w, bias, rows), F.linear(x, w, bias)
            assert got.shape == want.shape == (*x.shape[:-1], 96)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(bool(MKL), reason=MKL or "")
def test_the_mkl_kind_packs_each_row_count_once_within_its_budget():
    """A copy per weight and row count, made at the first product over that many rows and kept; past the budget of
    row counts, or MKL_ROWS rows, F.linear computes the product unpacked; below the plan's mkl rows, nothing is
    packed. Every product F.linear's."""
    import torch.nn.functional as F

    p = Projections(((1, "torch"), (3, "mkl")))
    p.mkl_copies = 2
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(48, 32, generator=g), torch.randn(24, 32, generator=g)
    for rows in (1, 2, 3, 4, 3, 5, MKL_ROWS + 1):
        for w in (w1, w2):
            x = torch.randn(rows, 32, generator=g)
            torch.testing.assert_close(p(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert sorted(p.mkl) == [3, 4]  # 5 rows past the budget of two counts; 17 past MKL_ROWS; 1-2 rows torch
    assert all(set(packs) == {w1.data_ptr(), w2.data_ptr()} for packs in p.mkl.values())
    first = p.mkl[3][w1.data_ptr()][1]
    p(torch.randn(3, 32, generator=g), w1)
    assert p.mkl[3][w1.data_ptr()][1] is first  # packed once


def test_a_projection_plan_picks_its_kind_by_rows_and_says_so():
    p = Projections(((1, "torch"), (4, "packed"), (16, "few-rows")))
    assert [p.kind(m) for m in (1, 3, 4, 15, 16, 300)] == ["torch", "torch", "packed", "packed", "few-rows",
                                                           "few-rows"]
    assert p.describe() == "1-3 rows torch, 4-15 rows packed, 16+ rows few-rows"
    assert Projections(((1, "few-rows"), (2, "torch"), (3, "packed"))).describe() == (
        "1 row few-rows, 2 rows torch, 3+ rows packed")
    assert Projections.of("packed").plan == ((1, "packed"),) and Projections.of("torch").describe() == "torch"
    for bad in ((), ((2, "torch"),), ((1, "fast"),)):
        with pytest.raises(ValueError, match="a projection plan starts at one row"):
            Projections(bad)


def test_auto_keeps_a_kind_only_where_it_is_a_margin_faster_than_f_linear():
    ms = {"torch": {1: 36, 2: 37, 4: 55, 8: 70, 16: 79}, "few-rows": {1: 77, 2: 79, 4: 79, 8: 80, 16: 82},
          "packed": {1: 44, 2: 45, 4: 48, 8: 56, 16: 69}}  # bench_linear.py's figures, Xeon with AMX, float32
    assert plan_from_times(ms) == ((1, "torch"), (4, "packed"))
    ms["packed"][16] = 75  # 5% faster at 16 rows: within the margin, F.linear again
    assert plan_from_times(ms) == ((1, "torch"), (4, "packed"), (16, "torch"))
    ms["few-rows"].update({1: 20, 2: 21})  # the fastest kind wins where several clear the margin
    assert plan_from_times(ms) == ((1, "few-rows"), (4, "packed"), (16, "torch"))


def test_the_runner_chooses_its_projections_by_measuring_on_a_cpu(tiny_target, monkeypatch):
    from eyas.speculate import target_forward as runner_mod

    runner = LeanRunner(tiny_target, tiny_target.default_feature_layers(), linear="few-rows")
    assert runner.projections.plan == ((1, "few-rows"),) and runner.linear_choice == "few-rows (as asked)"
    with pytest.raises(EyasError, match="projections 'few_rows' unknown"):
        runner.choose_linear("few_rows")
    said = runner.choose_linear("auto")
    assert said.startswith(runner.projections.describe() + " (measured, rows: ms by torch/few-rows")
    assert runner.length == 0 and runner.pending == 0  # measuring leaves an empty cache

    now, forward = [0.0], runner._forward
    speed = [None]  # speed(kind, rows): the time a forward over that many rows by that kind takes

    def timed_forward(ids, *args):  # under the measurement each kind is a one-entry plan
        now[0] += speed[0](runner.projections.plan[0][1], ids.shape[0])
        return forward(ids, *args)

    def clock(how):
        speed[0] = how
        return lambda: now[0]

    monkeypatch.setattr(runner, "_forward", timed_forward)
    monkeypatch.setattr(runner_mod.time, "perf_counter", clock(lambda k, m: 0.5 if k == "few-rows" else 1.0))
    assert runner.choose_linear("auto").startswith("few-rows (measured")
    monkeypatch.setattr(runner_mod.time, "perf_counter", clock(lambda k, m: 0.95 if k == "few-rows" else 1.0))
    assert runner.choose_linear("auto").startswith("torch (measured")  # within LINEAR_MARGIN: F.linear stays
    if not PACKING:  # packed products a third faster from 4 rows on
        monkeypatch.setattr(runner_mod.time, "perf_counter",
                            clock(lambda k, m: 0.66 if k == "packed" and m >= 4 else 1.0))
        assert runner.choose_linear("auto").startswith("1-3 rows torch, 4+ rows packed (measured")
        assert runner.projections.packed  # the forward's weights, packed once
    if not MKL:  # MKL's packed products a third faster from 4 rows on: the copies of 4, 8 and 16 rows are kept
        monkeypatch.setattr(runner_mod.time, "perf_counter",
                            clock(lambda k, m: 0.6 if k == "mkl" and m >= 4 else 1.0))
        said = runner.choose_linear("auto")
        assert said.startswith("1-3 rows torch, 4+ rows mkl (measured") and "for at most 8 counts" in said
        assert sorted(runner.projections.mkl) == [4, 8, 16] and runner.projections.mkl_copies == 8
        monkeypatch.setattr(runner_mod, "available_bytes", lambda: 9 * runner._weight_bytes())
        assert "/mkl:" not in runner.choose_linear("auto")  # 4 copies fit in half the memory, measuring packs 5
        runner.choose_linear("mkl")
        assert runner.projections.mkl_copies == 4 and runner.linear_choice == "mkl (as asked)"
    monkeypatch.undo()
    bf16 = dataclasses.replace(tiny_target, model=copy.deepcopy(tiny_target.model).to(torch.bfloat16))
    said = LeanRunner(bf16, bf16.default_feature_layers(), linear="auto").linear_choice
    assert "few-rows" not in said  # few_rows_linear is a float32 remedy; bf16 weighs F.linear and packed only
    with pytest.raises(EyasError, match="mkl projections asked for") as e:
        LeanRunner(bf16, bf16.default_feature_layers(), linear="mkl")
    assert "single precision (float32), not torch.bfloat16" in str(e.value)
    assert said.split(" (measured, rows: ms by ")[1].startswith(
        "torch: " if packing_unsupported(torch.bfloat16, "cpu") else "torch/packed: ")


@pytest.mark.parametrize("how", ["few-rows", "packed", "mkl"])
def test_a_projected_draft_proposes_what_the_draft_proposes(tiny_target, refs, how):
    """evaluate runs the drafts' linears as the runner computes its projections: the same weights, the same
    proposals here (the tiny draft has no near-ties), and the target's greedy output either way."""
    from eyas.speculate.quantize import ProjectedLinear, projected_draft

    if why := {"packed": PACKING, "mkl": MKL}.get(how):
        pytest.skip(why)
    draft = trained_draft(tiny_target)
    runner = LeanRunner(tiny_target, tiny_target.default_feature_layers(), linear=how)
    fast = projected_draft(draft, runner.projections)
    assert not any(isinstance(m, torch.nn.Linear) for m in fast.modules())
    assert sum(isinstance(m, ProjectedLinear) for m in fast.modules()) == sum(
        isinstance(m, torch.nn.Linear) for m in draft.modules())
    assert torch.equal(fast.lm_head.weight, draft.lm_head.weight) and any(isinstance(m, torch.nn.Linear)
                                                                          for m in draft.modules())  # a copy
    h = torch.randn(1, 3, draft.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fast.logits(h), draft.logits(h), rtol=1e-5, atol=1e-5)
    for prompt, ref in refs[:3]:
        rounds = {}
        for name, d in (("draft", draft), (how, fast)):
            g = speculative_generate(runner, Eagle3Drafter(d, k=4), prompt, NEW)
            assert g.tokens == ref
            rounds[name] = [r.accepted for r in g.rounds]
        assert rounds["draft"] == rounds[how]
