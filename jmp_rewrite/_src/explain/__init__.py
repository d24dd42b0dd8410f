"""Explain (a report stage): what the rewrite did to a program, equation by equation.

Reads the traced and painted program through ``rewrite`` (the same settings, graph and
painting) and the emitter's casts (``emit``). Hands on :class:`jmp_rewrite.Report` and its
views (by scope, source line or primitive; the lint; HTML) to the user.
"""
