"""``benchmarks/fp8_convergence.py --smoke``: issue 23's convergence script at toy sizes.

One subprocess (a few seconds of compiling) and checks of its JSON: every run trained on the
same batches, float8 ran where it should (none in float32 and bf16, more with the head than
without), the milestones come from bf16's curve, and float8's gradients are further from
float32's than bf16's. The synthetic language and the milestone arithmetic are checked
directly.
"""

from __future__ import annotations

import math
import pathlib
import sys

import numpy as np
import pytest
from benchmark_runs import run_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import fp8_convergence  # noqa: E402

RUNS = ("f32", "rw-bf16", "rw-fp8", "rw-fp8-all", "no-fc")
# A script over the public API: `make test` runs it, `make test-newest` need not.
pytestmark = pytest.mark.once


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("fp8_convergence") / "smoke.json"
    return run_script("fp8_convergence.py", out, "--rules", "no-fc=exclude=('*/fc',)")


def test_every_run_trained_with_float8_where_asked(smoke):
    result = smoke[0]
    runs = result["runs"]
    assert tuple(runs) == RUNS
    steps, trained = result["meta"]["steps"], result["meta"]["trained_steps"]
    assert trained == steps + math.ceil(0.05 * steps)  # --grace: 5% more steps
    for key, r in runs.items():
        assert len(r["losses"]) == trained and all(map(math.isfinite, r["losses"])), key
        assert r["final_smoothed"] < r["losses"][0], key  # it learns
    assert runs["f32"]["half_matmuls"] == 0 and runs["rw-bf16"]["half_matmuls"] > 0
    assert runs["f32"]["float8_matmuls"] == runs["rw-bf16"]["float8_matmuls"] == 0
    # the head (and the first layer) in float8 too: 2 more forward GEMMs, 3 GEMMs each
    assert runs["rw-fp8-all"]["float8_matmuls"] == runs["rw-fp8"]["float8_matmuls"] + 6
    # --rules: both blocks' first MLP GEMM (scope h_<i>/mlp/fc) kept bf16, 3 GEMMs each
    assert runs["no-fc"]["float8_matmuls"] == runs["rw-fp8"]["float8_matmuls"] - 6
    assert result["meta"]["rules"]["no-fc"]["exclude"] == ["*/fc"]
    # same parameters, same first batch: the first losses differ by rounding only
    first = [r["losses"][0] for r in runs.values()]
    assert max(first) - min(first) < 1e-2


def test_milestones_come_from_bf16_and_every_run_is_placed(smoke):
    result = smoke[0]
    rows = result["milestones"]
    assert [r["fraction"] for r in rows] == list(fp8_convergence.FRACTIONS)
    levels = [r["level"] for r in rows]
    assert levels == sorted(levels, reverse=True)
    # the last milestone is bf16's own final (averaged) loss
    assert levels[-1] == pytest.approx(result["runs"]["rw-bf16"]["final_smoothed"])
    for row in rows:
        assert row["steps"]["rw-bf16"] is not None
        assert set(row["steps"]) == set(RUNS)
        for key, d in row["rel_diff"].items():
            s, s_ref = row["steps"][key], row["steps"]["rw-bf16"]
            if s is None or not s_ref:
                assert d is None
            else:
                assert d == pytest.approx((s - s_ref) / s_ref)
    for key in ("rw-fp8", "rw-fp8-all", "no-fc"):
        within = all(d is not None and abs(d) <= 0.05 for d in (r["rel_diff"][key] for r in rows))
        assert result["runs"][key]["milestones_within_5pct"] is within


def test_float8_gradients_are_further_from_float32_than_bf16s(smoke):
    errors = smoke[0]["grad_errors"]
    assert set(errors) == set(RUNS) - {"f32"}
    for step, bf16 in errors["rw-bf16"].items():
        assert 0 < bf16["all"] < 0.02, step  # bf16's rounding: well under 2%
        for key in ("rw-fp8", "rw-fp8-all", "no-fc"):
            e = errors[key][step]
            assert 3 * bf16["all"] < e["all"] < 0.3, (key, step)  # float8: several times
            assert set(e) == set(bf16)


def test_report_is_printed(smoke):
    out = smoke[1]
    assert "Bayes-optimal loss of the language" in out
    assert "| bf16 drop | loss | f32 | rw-bf16 | rw-fp8 |" in out
    assert "| rw-fp8 | 0 |" in out


def test_language_batches_are_fixed_and_follow_the_chains():
    lang = fp8_convergence.TopicLanguage(32, topics=4, fan=3, seed=0)
    a, b = lang.batch(5, 6, 20), lang.batch(5, 6, 20)
    np.testing.assert_array_equal(a, b)  # the same step gives the same batch in every run
    assert not np.array_equal(a, lang.batch(6, 6, 20))  # a fresh batch each step
    for row in a:  # every transition is one of the successors of some topic...
        ok = [all(row[t + 1] in lang.successors[z, row[t]] for t in range(20)) for z in range(4)]
        assert any(ok)  # ...and of one topic for the whole sequence
    np.testing.assert_allclose(lang.trans.sum(-1), 1.0)


def test_bayes_loss_is_the_chain_entropy_once_the_topic_is_known():
    """One topic: no topic to infer, so the Bayes loss is the successors' entropy exactly
    (in expectation); with several topics it is higher, but below the bigram mixture's."""
    one = fp8_convergence.TopicLanguage(64, topics=1, fan=4, seed=1)
    entropy = -np.sum(one.probs * np.log(one.probs))
    toks = np.concatenate([one.batch(i, 64, 32) for i in range(4)])
    assert one.bayes_loss(toks) == pytest.approx(entropy, rel=0.03)
    assert one.bigram_loss(toks) == pytest.approx(one.bayes_loss(toks))  # nothing to infer
    many = fp8_convergence.TopicLanguage(64, topics=8, fan=4, seed=1)
    toks = np.concatenate([many.batch(i, 64, 32) for i in range(4)])
    assert entropy < many.bayes_loss(toks) < many.bigram_loss(toks) < np.log(8 * 4)


def test_milestones_and_smoothing_arithmetic():
    np.testing.assert_allclose(fp8_convergence.smooth([4.0, 2.0, 0.0, 2.0], 2), [4, 3, 1, 1])
    curves = {
        "rw-bf16": np.array([10.0, 8.0, 6.0, 4.0, 2.0]),
        "late": np.array([10.0, 9.0, 7.0, 5.0, 3.0]),
    }
    rows = fp8_convergence.milestones(curves, "rw-bf16", (0.5, 1.0))
    assert rows[0]["level"] == 6.0 and rows[0]["steps"] == {"rw-bf16": 2, "late": 3}
    assert rows[0]["rel_diff"]["late"] == pytest.approx(0.5)
    assert rows[1]["level"] == 2.0 and rows[1]["steps"]["late"] is None
    assert rows[1]["rel_diff"]["late"] is None
    # milestones from bf16's first 4 steps; the other run may reach them in its 5th (grace)
    rows = fp8_convergence.milestones(curves, "rw-bf16", (1.0,), steps=4)
    assert rows[0]["level"] == 4.0 and rows[0]["steps"] == {"rw-bf16": 3, "late": 4}
    assert rows[0]["rel_diff"]["late"] == pytest.approx(1 / 3)


def test_bad_rules_are_refused_with_the_expected_form():
    with pytest.raises(SystemExit, match="NAME=KEYWORDS"):
        fp8_convergence.main(["--smoke", "--rules", "oops"])
    with pytest.raises(TypeError, match="exclude"):
        fp8_convergence._parse_rules(["x=exclude='fc'"])
