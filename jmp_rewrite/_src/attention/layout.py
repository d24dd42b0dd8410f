"""Arranging a matched attention's arrays by their dims' labels (NumPy for constants,
``jax.numpy`` when emitting): a mask side's boolean value, an array moved to a given order of
labels and back."""

from __future__ import annotations

from typing import Any

from jmp_rewrite._src.attention.match import Label, Side

_COMPARE = {"ne": "not_equal", "eq": "equal", "gt": "greater", "ge": "greater_equal"}
_COMPARE |= {"lt": "less", "le": "less_equal"}


def mask_value(s: Side, x: Any, xp: Any) -> Any:
    """A mask side's boolean value: its comparison applied, negated for ``coef < 0``."""
    if s.test is not None:
        name, c, first = s.test
        fn = getattr(xp, _COMPARE[name])
        c = xp.asarray(c, x.dtype)
        x = fn(c, x) if first else fn(x, c)
    x = x.astype(bool)
    return x if s.coef > 0 else ~x


def arrange(x: Any, labels: tuple[Label, ...], order: list[Label], xp: Any) -> Any:
    """``x`` (dims ``labels``) with its dims in ``order``: size 1 where ``x`` has no such
    dim; its None dims (size 1) dropped."""
    keep = [i for i, lab in enumerate(labels) if lab is not None]
    present = [labels[i] for i in keep]
    sizes = {lab: x.shape[i] for lab, i in zip(present, keep, strict=True)}
    x = xp.reshape(x, [x.shape[i] for i in keep])
    x = xp.transpose(x, sorted(range(len(keep)), key=lambda j: order.index(present[j])))
    return xp.reshape(x, [sizes.get(lab, 1) for lab in order])


def place(
    y: Any, order: list[Label], labels: tuple[Label, ...], shape: tuple[int, ...], xp: Any
) -> Any:
    """The inverse of :func:`arrange`: ``y`` (dims ``order``) as an array of ``shape`` whose
    dims have ``labels``."""
    present = [lab for lab in labels if lab is not None]
    y = xp.reshape(y, [n for lab, n in zip(order, y.shape, strict=True) if lab in present])
    kept = [lab for lab in order if lab in present]
    y = xp.transpose(y, [kept.index(lab) for lab in present])
    return xp.reshape(y, shape)
