"""The lists: TF's allow/infer/deny/clear op lists, keyed by JAX primitive names, and the
environment variables that change them.

Reads nothing of the pipeline (the first stage). Hands on :class:`OpLists` (every
equation's list key and kind) to ``trace``, which keys the painting graph's nodes by them,
and to ``settings``, which resolves the lists a rewrite runs with.
"""
