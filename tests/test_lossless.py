"""The lossless check of `eyas evaluate` (eyas.speculate.lossless) on real bf16 runs of the tiny target: a replay
reproduces a run's own tokens, and catches a token the target did not choose and a cache that keeps the wrong rows."""

import copy
import dataclasses

import pytest
import torch

from eyas.core.target import load_target
from eyas.speculate import lossless
from eyas.speculate.decode import first_divergence, plain_generate, speculative_generate
from eyas.speculate.drafters import Eagle3Drafter
from eyas.speculate.results import _lossless, lossless_word, summary_lines
from eyas.speculate.target_forward import LeanRunner
from tests.speculate_helpers import random_prompts, trained_draft

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 40


class Tok:
    def decode(self, ids):
        return f"<{ids[0]}>"


@pytest.fixture(scope="module")
def run():
    """A bf16 run of the tiny target: its runner, and one chain-decoded turn per prompt as evaluate records it."""
    target = load_target("tiny", dtype="bfloat16")
    runner = LeanRunner(target, target.default_feature_layers())
    drafter = Eagle3Drafter(copy.deepcopy(trained_draft(load_target("tiny"))).to(torch.bfloat16), k=5)
    records = []
    for i, prompt in enumerate(random_prompts(16)[:4]):
        ref = plain_generate(runner, prompt, NEW).tokens
        g = speculative_generate(runner, drafter, prompt, NEW)
        records.append({"id": str(i), "turn": 1, "method": "chain", "prompt": prompt, "tokens": g.tokens,
                        "reference": ref, "divergence": first_divergence(ref, g.tokens),
                        "rounds": [dataclasses.asdict(r) for r in g.rounds]})
    return target, runner, records


def _fp32(target):
    """The fp32 twin of a target, its runner, and the cache-free fp32 logits that chose each token of a record."""
    t32 = dataclasses.replace(target, model=copy.deepcopy(target.model).float())
    runner32 = LeanRunner(t32, target.default_feature_layers())

    def rows(rec):
        n = len(rec["prompt"])
        logits = t32.model(torch.tensor([rec["prompt"] + rec["tokens"]])).logits[0].float()
        return logits[n - 1: n - 1 + len(rec["tokens"])]
    return runner32, rows


def test_a_replay_reproduces_the_runs_own_tokens_with_a_cache_equal_to_the_cache_free_forward(run):
    target, runner, records = run
    runner32, rows = _fp32(target)
    for rec in records:
        assert any(r["accepted"] > 0 for r in rec["rounds"])  # the draft is accepted: rounds of several tokens
        check = lossless.confirm_by_replay(runner32, runner, rec, rows(rec))
        assert check["reproduced"] and check["confirmed"], check
        assert check["fp32_cache_error"] < 1e-5  # fp32 incremental against one forward: rounding only


def test_a_replay_catches_a_token_the_target_did_not_choose(run):
    target, runner, records = run
    runner32, rows = _fp32(target)
    rec = dict(records[0])
    fp32 = rows(rec)
    rec["tokens"] = list(rec["tokens"])
    rec["tokens"][12] = int(fp32[12].argmin())  # the target's least likely token, inside an accepted stretch
    check = lossless.confirm_by_replay(runner32, runner, rec, rows(rec))
    assert not check["confirmed"] and check["first_not_reproduced"] == 12


def test_a_replay_catches_a_cache_that_keeps_the_wrong_rows(run, monkeypatch):
    """A decoder whose commit kept the rejected rows (the classic rollback fault) would emit tokens read from the
    wrong cache; replayed with that fault, the fp32 logits leave the cache-free forward's by whole units."""
    target, runner, records = run
    runner32, rows = _fp32(target)
    # a round rejected some, and a later round read the cache after it (a rejection in the last round leaves
    # nothing for the fault to corrupt)
    rec = next(r for r in records if any(x["accepted"] < x["size"] for x in r["rounds"][:-1]))
    commit = LeanRunner.commit
    monkeypatch.setattr(LeanRunner, "commit", lambda self, rows=None: commit(self, None))  # keeps every row
    check = lossless.confirm_by_replay(runner32, runner, rec, rows(rec))
    assert not check["confirmed"] and check["fp32_cache_error"] > 0.01, check


def test_a_replay_catches_a_fault_of_the_verify_path_that_only_the_runs_dtype_shows(run, monkeypatch):
    """A decoder whose verify forwards (several tokens at once) are off in the run's dtype alone, the same way every
    time (a mask value that overflows in bf16, say), emits tokens its replay reproduces, with a cache the fp32
    replay finds right: only the distance of its logits from fp32, against plain one-token decoding's, shows it."""
    target, runner, records = run
    runner32, rows = _fp32(target)
    torch.manual_seed(1)
    skew = torch.randn(target.vocab_size).to(target.dtype)  # logits of the tiny target span a few units
    forward = runner.forward

    def faulty(ids, *args, **kw):
        logits, feats = forward(ids, *args, **kw)
        return (logits + skew if ids.numel() > 1 else logits), feats
    monkeypatch.setattr(runner, "forward", faulty)
    drafter = Eagle3Drafter(copy.deepcopy(trained_draft(load_target("tiny"))).to(torch.bfloat16), k=5)
    prompt = records[0]["prompt"]
    g = speculative_generate(runner, drafter, prompt, NEW)
    rec = {"prompt": prompt, "tokens": g.tokens, "rounds": [dataclasses.asdict(r) for r in g.rounds]}
    check = lossless.confirm_by_replay(runner32, runner, rec, rows(rec))
    assert check["reproduced"] and check["fp32_cache_error"] < 1e-5  # what the replay checked before: both pass
    assert not check["confirmed"] and check["dtype_error"] > lossless.DTYPE_SPREAD * check["plain_dtype_error"]


def test_a_replay_that_cannot_be_run_as_recorded_is_not_confirmed_and_says_why(run):
    """Rounds that verified a tree (their shape is not in the round's figures) and rounds that do not cover the
    output (a record from elsewhere) are never confirmed: the turn stays a NO, with the reason and what to do."""
    target, runner, records = run
    runner32, rows = _fp32(target)
    rec = records[0]
    tree = {**rec, "rounds": [{**rec["rounds"][0], "size": rec["rounds"][0]["depth"] + 2}, *rec["rounds"][1:]]}
    check = lossless.confirm_by_replay(runner32, runner, tree, rows(rec))
    assert not check["confirmed"] and "tree" in check["why"] and "--dtype float32" in check["why"]
    short = {**rec, "rounds": rec["rounds"][:2]}
    covered = 1 + sum(r["accepted"] + 1 for r in short["rounds"])  # the prefill's token, then each round's
    check = lossless.confirm_by_replay(runner32, runner, short, rows(rec))
    assert not check["confirmed"] and f"cover {covered} of the {len(rec['tokens'])} tokens" in check["why"]


def test_rescore_settles_a_gap_beyond_rounding_by_replay_and_keeps_a_real_mismatch(run, monkeypatch):
    """With no rounding allowed (ULPS 0), every token off the fp32 top-1 goes to the replay: the run's own tokens
    are confirmed as the bf16 target's choices (yes*), a token it did not choose stays a NO that says why."""
    target, runner, records = run
    monkeypatch.setattr(lossless, "ULPS", 0)
    _, rows = _fp32(target)
    off = [r for r in records if any(int(rows(r)[j].argmax()) != t for j, t in enumerate(r["tokens"]))]
    assert off, "no bf16 token off the fp32 top-1 in these turns: the positive case is not exercised"
    own = [{**r, "divergence": 0} for r in off]  # checked from the first token on
    lossless.rescore(target, own, runner)
    assert all(r["rescore"]["mismatch"] is None for r in own)
    replayed = [t for r in own for t in r["rescore"]["ties"] if t.get("replayed")]
    assert replayed and all(t["fp32_gap"] > 0 for t in replayed)
    ok = _lossless(own, Tok())
    assert ok["lossless"] and lossless_word(ok) == "yes*"

    bad = {**records[0], "divergence": 0, "tokens": list(records[0]["tokens"])}
    fp32 = rows(bad)
    # inside an accepted stretch, and before any token of the run's own off the fp32 top-1 (with ULPS 0 the first
    # of those would be the mismatch reported)
    i = min([12] + [j for j, t in enumerate(bad["tokens"]) if int(fp32[j].argmax()) != t])
    bad["tokens"][i] = int(fp32[i].argmin())
    lossless.rescore(target, [bad], runner)
    assert bad["rescore"]["mismatch"]["index"] == i and not bad["replay"]["reproduced"]
    verdict = _lossless([bad], Tok())
    assert lossless_word(verdict) == "NO" and verdict["mismatch"]["replay_check"]["first_not_reproduced"] == i
    res = {"draft": {}, "latency_ms": {}, "baseline": {"eyas_greedy": {"tokens_per_s": 1.0}, "chosen": "plain",
                                                       "tokens_per_s": 1.0},
           "configs": [{"name": "chain", "tau": 1.0, "tokens_per_s": 1.0, "speedup": 1.0, "predicted_speedup": 1.0,
                        "efficiency": 1.0, "overhead_share": 0.0, "accept_rate_by_position": [],
                        "lossless": verdict}]}
    assert f"not reproduced from token {i}" in "\n".join(summary_lines(res))


def test_the_fp32_copy_is_the_models_in_fp32_tied_weights_tied_and_the_model_untouched(run):
    model = copy.deepcopy(run[0].model)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as many targets' heads are
    hook = model.model.layers[0].register_forward_hook(lambda *a: pytest.fail("a hook of the model's ran"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    c = lossless.fp32_copy(model)
    want = copy.deepcopy(model).float().state_dict()
    got = c.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert all(p.dtype == torch.float32 for p in c.parameters())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert c.lm_head.weight is c.model.embed_tokens.weight
    ids = torch.tensor([[1, 2, 3, 4]])
    got = c(ids).logits  # the copy runs without the model's hooks
    hook.remove()
    assert torch.equal(got, copy.deepcopy(model).float()(ids).logits)


def test_the_fp32_copy_goes_to_the_cpu_when_the_gpu_has_no_room(monkeypatch):
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * 2**30, 80 * 2**30))  # 10 GiB free
    assert lossless.fp32_device(gpu, 32 * 2**30) == torch.device("cpu")  # an 8B target in fp32
    assert lossless.fp32_device(gpu, 7 * 2**30) == gpu  # fits, with a quarter to spare
    assert lossless.fp32_device(gpu, 9 * 2**30) == torch.device("cpu")  # fits, but leaves no room to run
    assert lossless.fp32_device(torch.device("cpu"), 2**40) == torch.device("cpu")


def test_the_fp32_copy_asks_room_for_a_replay_runners_fused_weights(monkeypatch):
    """The lean replay runner fuses copies of about 60% of the weights: on a GPU the copy must leave room for them,
    or the replay runs out of memory and the check reports it could not tell."""
    asked = []
    monkeypatch.setattr(lossless, "fp32_device", lambda device, need: asked.append(need) or device)
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 2)).to(torch.bfloat16)  # 132 floats
    lossless.fp32_copy(model)
    lossless.fp32_copy(model, 0.6)
    assert asked == [132 * 4, int(132 * 4 * 1.6)]
