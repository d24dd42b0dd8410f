"""The installed package's smoke test (``make package-check``, CI): run with the interpreter of
a fresh environment that has only the built wheel (and its dependencies) installed, from a
directory outside the checkout, so that ``import jmp_rewrite`` can only find the installed copy.

It checks that the import comes from that environment, that ``jmp_rewrite.__version__`` is the
one in the wheel's metadata, that the command line answers, and that the README's Example runs
and prints what the README shows after it (``...`` as in ``tests/test_docs.py``: any text
within a line; a line of only ``...``: any lines).

Given the folder the wheel and the sdist were built into, it also checks that the sdist holds
every file of the wheel's package (the source a packager would build from).

Usage: ``python tools/package_smoke.py README.md dist`` (exit status 0 when all checks pass).
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from importlib.metadata import version

_EXAMPLE = re.compile(
    r"^## Example\n\n```python\n(?P<code>.*?)^```\n.*?"
    r"^<!-- readme-test: output -->\n```text\n(?P<output>.*?)^```",
    re.M | re.S,
)


def missing_output(expect: str, printed: str) -> str | None:
    """The first expected line not printed, in order, or None: ``...`` within a line is any
    text, a line of only ``...`` any lines (the rule ``tests/test_docs.py`` checks outputs by)."""
    got = [ln.rstrip() for ln in printed.splitlines()]
    pos, gap = 0, False
    for want in (ln.rstrip() for ln in expect.strip("\n").splitlines()):
        if want.strip() == "...":
            gap = True
            continue
        pattern = re.compile(".*".join(re.escape(part) for part in want.split("...")))
        for k in range(pos, len(got) if gap else min(pos + 1, len(got))):
            if pattern.fullmatch(got[k]):
                pos, gap = k + 1, False
                break
        else:
            return want
    return None


def check_sdist(dist: str) -> None:
    """The sdist in ``dist`` holds every file of the package in the wheel there."""
    (wheel,) = glob.glob(os.path.join(dist, "jmp_rewrite-*.whl"))
    (sdist,) = glob.glob(os.path.join(dist, "jmp_rewrite-*.tar.gz"))
    with zipfile.ZipFile(wheel) as z:
        packaged = {n for n in z.namelist() if n.startswith("jmp_rewrite/")}
    with tarfile.open(sdist) as t:
        source = {n.partition("/")[2] for n in t.getnames()}
    missing = sorted(packaged - source)
    assert not missing, f"{sdist} lacks {missing}"
    print(f"{os.path.basename(sdist)} holds the {len(packaged)} files of the wheel's package")


def main(readme: str, dist: str) -> int:
    check_sdist(dist)
    import jmp_rewrite

    site = os.path.realpath(sysconfig.get_paths()["purelib"])
    where = os.path.realpath(jmp_rewrite.__file__)
    assert where.startswith(site + os.sep), f"jmp_rewrite imported from {where}, not {site}"
    assert jmp_rewrite.__version__ == version("jmp_rewrite") != "0.0.0", jmp_rewrite.__version__
    print(
        f"jmp_rewrite {jmp_rewrite.__version__} from {os.path.dirname(where)}, jax {version('jax')}"
    )

    cli = subprocess.run(
        [sys.executable, "-m", "jmp_rewrite", "--help"], capture_output=True, text=True
    )
    assert cli.returncode == 0 and "explain" in cli.stdout, cli.stdout + cli.stderr

    with open(readme, encoding="utf-8") as f:
        match = _EXAMPLE.search(f.read())
    assert match, f"{readme}: no '## Example' python block followed by its output"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(match["code"], f"{readme} (Example)", "exec"), {"__name__": "__main__"})
    print(printed.getvalue(), end="")
    missing = missing_output(match["output"], printed.getvalue())
    assert missing is None, f"the README's Example did not print {missing!r}"
    print("the installed package runs the README's Example as shown")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
