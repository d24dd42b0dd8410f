"""Compare (a report stage): the numerics debugger, a program run in float32 and rewritten
side by side on concrete inputs.

Reads the traced and painted program through ``rewrite`` and runs the emitter's loop eagerly
(``emit``). Hands on :class:`jmp_rewrite.Comparison` (per-equation errors) and its
suggestions (the list change or float32 region that would remove a problem) to the user.
"""
