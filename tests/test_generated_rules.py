"""Issue 29: the generated programs (``tests/program_gen.py``) under rules drawn at random.

The float64 oracle (``tests/test_oracle.py``) runs programs; these tests only trace and paint
them (nothing compiles), checking decisions against the rules restated here:

* **float8 rules** (``rewrite(..., dtype=bfloat16, fp8=Fp8Rules(...))``) drawn from the
  program's own matmul scopes and source lines: include and exclude patterns (the same one
  in both, sometimes), ``keep_first``/``keep_last``, ``min_dim``/``multiple``. A float8 matmul
  is a half-precision ``dot_general`` that no exclude pattern names; a forward one an include
  pattern names (and no exclude pattern) runs in float8; one not included passed the shape
  rule; every half forward matmul left in bfloat16 says why; explain's shares agree with the
  independent count (``tests/explain_oracle.py``).
* **platform decisions** on a faked first device (``jax.devices``): with ``dtype=None`` the
  program is painted exactly as with the dtype TF's rule picks for that device (float16 on
  CUDA GPUs of compute capability >= 7.0, bfloat16 on TPUs), or left unchanged with the
  reason.

Derandomized in CI (profile ``ci``), a few examples each (tracing only: about 10 s).
"""

from __future__ import annotations

import fnmatch

import explain_oracle
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from program_gen import Program, programs, transformed

import jmp_rewrite

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")

BF16 = jnp.bfloat16
PAINTED_WHOLE = ("none", "grad_inner", "vmap_inner")  # rewrite(f), rewrite(grad f), ...


def _traced(program: Program):
    fun = transformed(program, lambda f: f)
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), program.inputs(0))
    return fun, args


def _names(e) -> list[str]:
    return [n for n in (e.scope, e.source) if n]


def _matches(patterns, e) -> bool:
    return any(fnmatch.fnmatchcase(n, p) for p in patterns for n in _names(e))


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_generated_programs_under_drawn_float8_rules(data):
    program = data.draw(programs(PAINTED_WHOLE), label="program")
    fun, args = _traced(program)
    plain = jmp_rewrite.explain(fun, args, dtype=BF16, residuals=False)
    half = [e for e in plain.equations if e.primitive == "dot_general" and e.half]
    names = sorted({n for e in half for n in _names(e)})
    pick = st.lists(st.sampled_from(names), max_size=2, unique=True) if names else st.just([])
    include = data.draw(pick, label="include")
    exclude = data.draw(st.one_of(pick, st.just(include)), label="exclude")
    rules = jmp_rewrite.Fp8Rules(
        include=tuple(include),
        exclude=tuple(exclude),
        min_dim=data.draw(st.sampled_from([8, 16, 256]), label="min_dim"),
        multiple=data.draw(st.sampled_from([8, 16]), label="multiple"),
        keep_first=data.draw(st.booleans(), label="keep_first"),
        keep_last=data.draw(st.booleans(), label="keep_last"),
    )
    report = jmp_rewrite.explain(fun, args, dtype=BF16, fp8=rules, residuals=False)
    assert [(e.path, e.colour) for e in report.equations] == [
        (e.path, e.colour) for e in plain.equations
    ], "float8 rules changed the bfloat16 painting"
    for e in report.equations:
        where = f"{e.path} ({e.scope}, {e.source}) under {rules}"
        if e.float8:
            assert e.primitive == "dot_general" and e.half, where
            assert not _matches(rules.exclude, e), f"excluded, yet float8: {where}"
            formats = e.float8.split(" x ")
            assert formats == ["e4m3", "e4m3"] if e.phase == "forward" else "e5m2" in formats
            if e.phase == "forward" and not _matches(rules.include, e):
                dims = [d for _, d in e.tensor_dims]
                assert all(d >= rules.min_dim and d % rules.multiple == 0 for d in dims), where
        elif e.primitive == "dot_general" and e.half and e.phase == "forward":
            assert e.float8_left, f"a half matmul left bfloat16 without a reason: {where}"
            if _matches(rules.include, e) and not _matches(rules.exclude, e):
                pytest.fail(f"included and not excluded, yet bfloat16: {where}")
            if _matches(rules.exclude, e):
                assert e.float8_left.startswith("excluded by "), where
    closed = jax.make_jaxpr(fun)(args)
    assert explain_oracle.problems(closed, report) == []
    # and the rewrite traces with these rules, keeping every output's shape and dtype
    out = jax.eval_shape(jmp_rewrite.rewrite(fun, dtype=BF16, fp8=rules), args)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), out) == jax.tree.map(
        lambda a: (a.shape, a.dtype), jax.eval_shape(fun, args)
    )


class FakeDevice:
    def __init__(self, platform: str, compute_capability: str | None):
        self.platform = platform
        if compute_capability is not None:
            self.compute_capability = compute_capability


DEVICES = st.one_of(
    st.builds(
        FakeDevice,
        st.sampled_from(["gpu", "cuda"]),
        st.sampled_from(["5.2", "6.0", "6.1", "7.0", "7.5", "8.0", "8.6", "8.9", "9.0", None]),
    ),
    st.builds(FakeDevice, st.sampled_from(["tpu", "cpu", "METAL"]), st.none()),
)


def _platform_rule(device: FakeDevice):
    """TF's rule, restated: float16 on a CUDA GPU of compute capability >= 7.0, bfloat16 on
    a TPU, nothing elsewhere."""
    if device.platform == "tpu":
        return np.dtype(BF16)
    cc = getattr(device, "compute_capability", None)
    if device.platform in ("gpu", "cuda") and cc is not None:
        return np.dtype(jnp.float16) if float(cc) >= 7.0 else None
    return None


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=programs(PAINTED_WHOLE), device=DEVICES)
def test_generated_programs_on_faked_devices(program, device):
    fun, args = _traced(program)
    want = _platform_rule(device)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jax, "devices", lambda *a: [device])
        report = jmp_rewrite.explain(fun, args, residuals=False)
    if want is None:
        assert report.dtype == "none" and not report.changed and report.off_reason, report
        return
    assert report.dtype == want.name and not report.off_reason
    pinned = jmp_rewrite.explain(fun, args, dtype=want, residuals=False)
    assert [(e.path, e.colour, e.painted_by) for e in report.equations] == [
        (e.path, e.colour, e.painted_by) for e in pinned.equations
    ]
