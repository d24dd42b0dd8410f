"""The command line, ``python -m jmp_rewrite {demo,explain,compare}``: the last stage.

Reads the user's function and its example arguments (``cli/inputs.py``) and calls the public
API (``jmp_rewrite``). Hands on the reports, printed.
"""
