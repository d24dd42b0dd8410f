"""Re-bless the painting goldens (``tests/goldens/``) and print what changed.

The painting goldens pin every decision of the rewrite on a corpus of programs
(``tests/golden_corpus.py``, ``tests/golden_text.py``, checked by ``tests/test_goldens.py``).
When a change of the code changes a painting on purpose, this script rewrites the files from
the code and prints the unified diff: review it, then commit it with the change.

The base files hold the text of the oldest JAX the project supports (0.10); a newer JAX whose
jaxprs differ for some programs keeps those blocks in ``tests/goldens/jax-X.Y/``. So bless on
both ends, the floor first (``make goldens`` does)::

    .venv/bin/python tools/goldens.py --bless            # jax 0.10: the base files
    .venv-newest/bin/python tools/goldens.py --bless     # jax 0.12: its own blocks
    .venv/bin/python tools/goldens.py                    # check only: diff, exit 1 if any
    .venv/bin/python tools/goldens.py -k models --bless  # one family
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import golden_corpus  # noqa: E402
import golden_text  # noqa: E402
from test_goldens import family_blocks  # noqa: E402

from jmp_rewrite._src.lists import environment  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bless", action="store_true", help="rewrite the golden files")
    parser.add_argument("-k", "--family", action="append", help="only these families")
    parser.add_argument("--quiet", action="store_true", help="no diff, only the summary")
    args = parser.parse_args(argv)
    families = args.family or list(golden_corpus.FAMILIES)
    unknown = [f for f in families if f not in golden_corpus.FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {list(golden_corpus.FAMILIES)}")
    for name in [n for n in os.environ if environment.is_ours(n)]:
        del os.environ[name]  # the goldens set their own lists and variables
    version = golden_text.version_key()
    changed = 0
    for family in families:
        start = time.process_time()
        want = golden_text.expected(family)
        got = family_blocks(family)
        differ = [h for h in got if want.get(h) != got[h]] + [h for h in want if h not in got]
        seconds = time.process_time() - start
        lines = sum(b.count("\n") + 1 for b in got.values())
        print(
            f"{family}: {len(got)} paintings, {lines} lines, {len(differ)} changed "
            f"({seconds:.1f} s CPU, {version})"
        )
        if differ and not args.quiet:
            print(golden_text.diff(family, want, got))
        if differ:
            changed += 1
        if args.bless:
            path = golden_text.bless(family, got)
            what = "wrote" if path.is_file() else "no blocks of its own, none in"
            print(f"  {what} {path.relative_to(ROOT)}")
    if changed and not args.bless:
        print(f"{changed} families differ: {golden_text.BLESS_COMMAND}")
    return 1 if changed and not args.bless else 0


if __name__ == "__main__":
    sys.exit(main())
