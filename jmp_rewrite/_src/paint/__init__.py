"""Paint: TF's painting passes (and jmp_rewrite's additions) on the flat graph.

Decides, for every node, half precision or float32 and which pass decided it; no pass changes
the graph. Reads the painting graph (``trace``), the attention selection (``attention``) and
the float8 choice (``fp8``). Hands on the :class:`~jmp_rewrite._src.paint.painting.Painting`
to ``emit``.
"""
