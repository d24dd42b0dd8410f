"""What JAX's TPU flash-attention kernel takes of a fused attention.

On a TPU lowering a fused attention runs as ``jax.experimental.pallas.ops.tpu.flash_attention``
(a Mosaic kernel, forward and backward; the same module in jax 0.10 to 0.12), emitted by
:mod:`~jmp_rewrite._src.emit.tpu_attention`. The kernel takes queries, keys and values of
the same heads (grouped keys and values are repeated), a causal mask (top-left aligned, as
``tril``), per-token *segment ids* (a query attends a key where their ids are equal: a
padding mask of the queries or of the keys, or both, is one), and a bias ``ab`` at the
logits' full size only. A bias per key (Hugging Face's additive padding mask ``(B, 1, 1,
S)``) or per query needs none: it is one more head dim of the keys (or queries) against a
column of ones. Lengths are padded to its 128-wide blocks (padded keys masked by their
segment id, padded queries dropped), float16 runs in float32 (the chip has no float16
matrix unit).

:func:`refusal` says why it cannot take one (``""`` when it can). Such an attention is
still fused elsewhere (cuDNN on CUDA, JAX's own attention on a CPU); on a TPU it runs as
written -- the rewrite's own equations for it, as without ``fuse_attention`` -- because JAX's
XLA attention there keeps more than the written-out attention does (2.7x its temporaries,
measured 2026-12-01).
"""

from __future__ import annotations

from jmp_rewrite._src.attention.match import Core

#: The kernel's lane width: its key blocks (and so the padded key length) are multiples.
LANES = 128


def _heads_label(core: Core) -> int | None:
    """The label of the heads among the logits' batch dims (the last one, when two or more:
    a single batch dim is the batch)."""
    return len(core.batch) - 1 if len(core.batch) > 1 else None


def head_dim(core: Core) -> int:
    return int(core.q.aval.shape[core.q_labels.index("d")])


def _labels(sides) -> set:
    return {lab for s in sides for lab in s.dims if lab is not None}


def refusal(core: Core) -> str:
    """Why the TPU kernel cannot compute ``core`` (a sentence), or ``""``."""
    heads = _heads_label(core)
    for m in core.masks:
        labels = {lab for lab in m.dims if lab is not None}
        if heads is not None and heads in labels:
            return (
                "a mask differs between heads: the TPU kernel takes a causal mask and masks "
                "per query or key token (segment ids) only"
            )
        if "t" in labels and "s" in labels:
            return (
                "a mask over both queries and keys that is not causal (tril): the TPU kernel "
                "takes a causal mask and masks per query or key token (segment ids) only"
            )
    if {"t", "s"} <= _labels(core.biases):  # not one per key, nor one per query
        if core.group > 1:
            return (
                "a bias over queries and keys under grouped-query attention: the TPU kernel "
                "takes such a bias only at the logits' full size, which repeating it for each "
                "query head would write"
            )
        full = {i for i, n in enumerate(core.batch) if n > 1}
        full |= {lab for lab, n in (("t", core.t), ("s", core.s)) if n > 1}
        for b in core.biases:
            if not full <= {lab for lab in b.dims if lab is not None}:
                return (
                    f"a bias over queries and keys broadcast to the logits (its array is "
                    f"{tuple(b.atom.aval.shape)}): the TPU kernel takes such a bias only at the "
                    "logits' full size (batch, heads, queries, keys), which broadcasting it "
                    "would write, and writes its gradient at that size"
                )
    d = head_dim(core)
    if d > LANES and d % LANES:
        return f"head dim {d}: the TPU kernel takes head dims up to {LANES} or multiples of {LANES}"
    return _keeps_more(core, d)


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def padded_lengths(t: int, s: int) -> tuple[int, int]:
    """The query and key lengths the kernel is given: queries up to 128 to a multiple of 8
    (one block), longer ones and the keys to multiples of 128."""
    return (round_up(t, 8) if t <= LANES else round_up(t, LANES)), round_up(s, LANES)


def _keeps_more(core: Core, d: int) -> str:
    """Why the kernel would keep more for the backward pass than the written-out attention
    (or ``""``), per batch and head: its queries, keys, values and output at the padded
    lengths, in 128-wide tiles (the chip's lanes; a head dim of 64 takes a tile), and its
    float32 row maxima and sums, against the probabilities in the half dtype. Equal at 512
    queries and keys (head dims up to 128), half at 1024. Measured on a v5p (2026-12-02):
    GPT-2 small's train step (T1024) keeps 0.65x the temporaries of the written-out one with
    the kernel, ViT-B/16's (T197, padded to 256) 1.75x."""
    tp, sp = padded_lengths(core.t, core.s)
    dp = round_up(d + (1 if core.biases and not _full(core) else 0), LANES)
    kernel = 2 * (tp + sp) * dp * 2 + 2 * tp * 4
    written = core.t * core.s * 2
    if kernel < written:
        return ""
    return (
        f"at {core.t} queries and {core.s} keys the TPU kernel keeps more for the backward "
        f"pass ({kernel:,} bytes per head: queries, keys, values and output padded to "
        f"{tp}/{sp} positions and 128-wide tiles) than the written-out attention keeps "
        f"({written:,} bytes per head: its probabilities)"
    )


def _full(core: Core) -> bool:
    return {"t", "s"} <= _labels(core.biases)
