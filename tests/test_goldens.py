"""Issue 29: every painting decision of the corpus is pinned, exactly (FileCheck-style goldens).

For each family of ``tests/golden_corpus.py`` the test traces its programs, paints them under
each configuration and compares the canonical text (``tests/golden_text.py``: per vertex the
list, colour, the pass or rule that decided it, dtypes, float8 choice, FLOPs, casts) with the
blessed file ``tests/goldens/FAMILY.golden`` (and, on the newest JAX, the blocks stored for it
under ``tests/goldens/jax-X.Y/``). Any change of a decision on any program fails here until
someone looks at it: run ``make goldens`` (``tools/goldens.py --bless``), read the diff it
prints, and commit the files with the change that caused it.

Nothing is compiled: tracing and painting only (about 30 s of CPU for the whole corpus).
"""

from __future__ import annotations

import os

import explain_oracle
import golden_corpus
import golden_text
import pytest

from jmp_rewrite._src.lists import environment

pytestmark = pytest.mark.usefixtures("leak_check_only_where_asked")


@pytest.fixture(autouse=True)
def _no_list_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    """No JMP_REWRITE_* (or TF_AUTO_MIXED_PRECISION_*) variable of the caller's environment
    changes the lists: the goldens set their own where a configuration says so."""
    for name in [n for n in os.environ if environment.is_ours(n)]:
        monkeypatch.delenv(name)


def family_blocks(family: str, oracle: list[str] | None = None) -> dict[str, str]:
    """Header -> block of every painting of ``family``, as the code paints it now; with
    ``oracle``, the disagreements of explain's numbers with the independent count
    (``tests/explain_oracle.py``) are appended to it."""
    blocks: dict[str, str] = {}
    for case in golden_corpus.FAMILIES[family]():
        closed, painted = golden_text.paintings(case)
        for header, p in painted:
            assert header not in blocks, f"two programs named {header}"
            blocks[header] = golden_text.block(case, header, p)
            if oracle is not None:
                oracle += [f"{header}: {x}" for x in explain_oracle.problems(closed, p.report)]
    return blocks


@pytest.mark.parametrize("family", list(golden_corpus.FAMILIES))
def test_painting_goldens(family):
    """The family's paintings are the blessed ones, and explain's FLOPs, trips and shares on
    each agree with the independent count."""
    want = golden_text.expected(family)
    assert want, (
        f"no goldens for {family}: run {golden_text.BLESS_COMMAND} and commit "
        f"tests/goldens/{family}.golden"
    )
    oracle: list[str] = []
    got = family_blocks(family, oracle)
    assert not oracle, "explain's numbers disagree with the independent count:\n" + "\n".join(
        oracle[:20]
    )
    if got != want:
        changed = sum(1 for h in got if want.get(h) != got[h]) + sum(
            1 for h in want if h not in got
        )
        pytest.fail(
            f"{changed} painting(s) of {family} differ from the blessed goldens. If the change "
            f"is intended, run {golden_text.BLESS_COMMAND}, review the diff and commit it.\n"
            + golden_text.diff(family, want, got, limit=200),
            pytrace=False,
        )
