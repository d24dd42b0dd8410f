"""The flow is one-way: painting reads the graph and writes the Painting, never the graph.

Every per-node decision (colour, kind override, kept float32, float8 choice) lives in the
:class:`~jmp_rewrite._src.paint.painting.Painting`; so painting a graph twice gives equal paintings,
and ``deny_releases``' what-if repaints leave the graph as the first painting saw it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jmp_rewrite as jr
from jmp_rewrite._src.paint.painting import DENY, UNLISTED
from jmp_rewrite._src.paint.passes import deny_releases, paint
from jmp_rewrite._src.trace.graph import Graph

F16, BF16 = jnp.float16, jnp.bfloat16


def _layer_norm(h):
    mean = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
    return (h - mean) * jax.lax.rsqrt(var + 1e-5)


def _block(w1, w2, w3, x):
    """A LayerNorm (statistics kept float32, their deny released), a tanh-GELU (its ``x**3``
    only feeds the tanh: released) and a cube read by a matmul (stays deny)."""
    h = _layer_norm(x @ w1)
    g = jax.nn.gelu(h @ w2, approximate=True)
    return jnp.sum((g**3) @ w3)


def _args(d=8):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    return (
        jax.random.normal(k1, (d, d)) * 0.3,
        jax.random.normal(k2, (d, d)) * 0.3,
        jax.random.normal(k3, (d, d)) * 0.3,
        jax.random.normal(k4, (4, d)),
    )


def _graph(fun, args, dtype):
    closed = jax.make_jaxpr(fun)(*args)
    return Graph(closed, jr.default_lists(dtype), dtype)


def _snapshot(g: Graph):
    """Every field of every node, and the graph's own painting inputs."""
    nodes = [
        tuple((f.name, tuple(v) if isinstance(v, list) else v) for f, v in _fields(n))
        for n in g.nodes
    ]
    return (
        nodes,
        [(s, o) for s, o, _ in g.outputs],
        list(g.unrun_carries),
        sorted(g.outside_handoffs),
        sorted(g.choice_cases.items()),
        g.opaque_allow,
        len(g.loop_states),
    )


def _fields(n):
    return [(f, getattr(n, f.name)) for f in dataclasses.fields(n)]


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "grad"])
def test_painting_leaves_the_graph_untouched_and_repeats(grad):
    fun = jax.grad(_block, argnums=(0, 1, 2)) if grad else _block
    g = _graph(fun, _args(), F16)
    before = _snapshot(g)
    p = paint(g)
    assert _snapshot(g) == before
    # Both kind-changing passes ran (the model exercises them), and recorded it here only.
    assert set(p.released.values()) == {
        "keep_normalization_statistics_float32",
        "release_saturated_powers",
    }
    for i in p.released:
        assert g.nodes[i].kind == DENY and p.kind_of(g.nodes[i]) == UNLISTED
    assert "keep_normalization_statistics_float32" in p.kept.values()
    assert all(g.nodes[i].process and not p.processes(g.nodes[i]) for i in p.kept)
    # The cube read by the last matmul is still deny, and spreads it.
    assert any(g.nodes[i].key == "integer_pow" for i in p.deny)
    again = paint(g)
    assert again == p
    releases = deny_releases(g, p, {})
    assert _snapshot(g) == before
    assert paint(g) == p
    assert releases and {k for keys in releases.values() for k in keys} >= {"integer_pow"}


def _cubed(w1, w2, w3, x):
    return jnp.sum((_layer_norm(x @ w1) ** 3) @ w2 + x @ w3)


def test_deny_releases_agree_with_moving_the_key():
    """A what-if repaint equals the painting of the graph built with the key on infer (no
    released power here: a what-if keeps a power released that the move would paint)."""
    g = _graph(_cubed, _args(), F16)
    p = paint(g)
    releases = deny_releases(g, p, {})
    moved = Graph(
        jax.make_jaxpr(_cubed)(*_args()),
        jr.default_lists(F16).move("integer_pow", to="infer"),
        F16,
    )
    q = paint(moved)
    expected = {i for i in q.allow - p.allow if g.nodes[i].eqn is not None}
    assert expected and {i for i, keys in releases.items() if "integer_pow" in keys} == expected


def test_float8_choice_lives_in_the_painting():
    rules = jr.Fp8Rules(min_dim=1, multiple=1, keep_first=False, keep_last=False)
    g = _graph(jax.grad(_block, argnums=(0, 1, 2)), _args(16), BF16)
    before = _snapshot(g)
    p = paint(g, fp8=rules)
    assert _snapshot(g) == before
    assert p.fp8 is not None and p.fp8.dots
    assert all(i in p.allow for i in p.fp8.dots)
    assert paint(g, fp8=rules) == p
    assert paint(g).fp8 is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.fp8.dots = {}


def test_the_fused_attention_choice_lives_in_the_painting():
    """``fuse_attention``: which attentions are replaced is the painting's; painting twice
    gives equal choices and leaves the graph as it was."""

    def attention(q, k, v):
        s = jnp.einsum("td,sd->ts", q, k) / 4.0
        return jnp.sum(jax.nn.softmax(s) @ v)

    args = [jax.random.normal(k, (8, 16)) for k in jax.random.split(jax.random.key(1), 3)]
    g = _graph(jax.grad(attention, argnums=(0, 1, 2)), args, BF16)
    before = _snapshot(g)
    p = paint(g, attention=True)
    assert _snapshot(g) == before
    assert len(p.attention.fused) == 1 and p.attention.fused[0].backward_at is not None
    assert paint(g, attention=True) == p
    assert paint(g).attention is None
