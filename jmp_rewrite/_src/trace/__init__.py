"""Trace: a program's arguments traced to a jaxpr, and the jaxpr read as one flat graph.

Decides what each equation is (its list key, its float types, the jaxprs it holds, where it
comes from: scope, source line, phase, float32 region) and where values come from (copies,
constants, state). Reads the op lists (``lists``). Hands on the painting graph
(:class:`~jmp_rewrite._src.trace.graph.Graph`: nodes, fan-in/fan-out, per-equation records)
to ``attention``, ``fp8``, ``paint`` and ``emit``; ``loss_scale`` reads only its float32
region mark (``regions.py``).
"""
