"""Emit: the painted jaxpr re-emitted under the caller's trace, with casts where painted.

Decides where casts go (lazily, once per value and dtype), which constants are clamped to the
half range, which derivatives are taken in float32, and how custom derivative rules and fused
attentions are re-wrapped. Reads the graph (``trace``) and the painting (``paint``). Hands on
the rewritten program (to ``rewrite``) and what it does to each equation
(``emit/facts.py``: the record ``rewrite``'s ``paint``, ``explain`` and ``compare`` share).
"""
