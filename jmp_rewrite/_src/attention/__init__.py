"""Fused attention (``fuse_attention=True``): which attentions of a traced program are
replaced by one ``jax.nn.dot_product_attention``.

Reads the jaxpr and its painting graph (``trace``): matches each forward attention by meaning
(and its backward, when the program is differentiated). Hands on the selection to ``paint``
(the painting records it) and the matches to ``emit`` (``emit/attention.py`` emits the call).
"""
