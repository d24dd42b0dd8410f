"""Mutation testing, by hand: does the suite catch realistic bugs in ``jmp_rewrite/_src``?

Each mutant of :data:`tools.mutant_list.MUTANTS` is one small change to one line of the
library (a ``<`` for a ``<=``, an ``any`` for an ``all``, a rule dropped) with the tests that
should catch it. The script copies the work tree (tracked and untracked files, not ignored
ones) to a temporary folder, applies one mutant at a time there, runs that mutant's tests
(``pytest -x -q -p no:cacheprovider``, hypothesis' derandomized ``ci`` profile) and reports
each mutant as

* ``caught``: a test failed (or timed out);
* ``survived``: every test passed -- a bug the suite would let through. A mutant expected
  to survive (``survives=`` in the list: an equivalent change, or one no test can see) is
  listed with its explanation;
* ``stale``: its original text no longer occurs exactly once in the source (the list needs
  updating; ``tests/test_mutant_list.py`` fails too);
* ``error``: pytest could not run its tests (a test id that no longer exists...).

First, unless ``--no-baseline``, the selected mutants' tests run once on the unmutated copy:
a test failing there would count every mutant it targets as caught, so the script stops.

The work tree itself is never modified. The score is ``caught / (caught + survived)``.
The summary goes to standard output and, as Markdown, to ``--out``. The exit status is
nonzero only when the script itself fails or a mutant is stale or in error.

Usage (from the repository root; it is not part of ``make test``)::

    .venv/bin/python tools/mutants.py                  # every mutant (~10 min on 2 cores)
    .venv/bin/python tools/mutants.py -j 2             # two at a time (two copies)
    .venv/bin/python tools/mutants.py -k 'loss_scale|emit'   # names matching a regex
    .venv/bin/python tools/mutants.py --list           # the mutants, nothing run
    .venv/bin/python tools/mutants.py --check          # snippets still match? nothing run
    # the score of an older suite on today's source: its tests/ at a commit, the whole
    # files the mutants name and, for each module, the files that test it (BROAD)
    .venv/bin/python tools/mutants.py --tests-at e6aebb2 --broad
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import importlib
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.mutant_list import MUTANTS, Mutant  # noqa: E402

#: With ``tools/mutants.py --broad``: the test files run for every mutant of a module, after
#: its own (to score a suite whose tests do not target the mutants, e.g. an older one).
_REWRITE_FILES = (
    "tests/test_rewrite.py",
    "tests/test_tf_patterns.py",
    "tests/test_invariants.py",
    "tests/test_op_lists.py",
)
_LOSS_SCALE_FILES = ("tests/test_loss_scale.py", "tests/test_loss_scale_optimizer.py")
_LOSS_SCALE_FILES += ("tests/test_loss_scale_misuse.py",)
BROAD: dict[str, tuple[str, ...]] = {
    **{
        "jmp_rewrite/_src/" + m: _REWRITE_FILES
        for m in (
            "paint/passes.py",
            "paint/additions.py",
            "paint/painting.py",
            "trace/graph.py",
            "trace/origins.py",
            "emit/emitter.py",
            "trace/higher_order.py",
        )
    },
    "jmp_rewrite/_src/lists/op_lists.py": _REWRITE_FILES,
    "jmp_rewrite/_src/lists/environment.py": _REWRITE_FILES,
    "jmp_rewrite/_src/trace/equations.py": _REWRITE_FILES,
    "jmp_rewrite/_src/fp8.py": ("tests/test_fp8.py",),
    **{
        "jmp_rewrite/_src/" + m: ("tests/test_explain.py", "tests/test_explain_view.py")
        for m in ("explain/build.py", "explain/report.py", "explain/view.py", "explain/lint.py")
    },
    **{
        "jmp_rewrite/_src/" + m: ("tests/test_compare.py",)
        for m in ("compare/run.py", "compare/eager.py")
    },
    "jmp_rewrite/_src/loss_scale/scale.py": _LOSS_SCALE_FILES,
    "jmp_rewrite/_src/loss_scale/optimizer.py": _LOSS_SCALE_FILES,
    "jmp_rewrite/_src/loss_scale/finite.py": _LOSS_SCALE_FILES,
}


PYTEST_ARGS = ("-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-n", "0")


@dataclasses.dataclass
class Outcome:
    mutant: Mutant
    status: str  # caught | survived | stale | error
    seconds: float = 0.0
    detail: str = ""


def occurrences(text: str, snippet: str) -> int:
    return text.count(snippet)


def stale_reason(mutant: Mutant, root: pathlib.Path) -> str:
    """Why a mutant cannot be applied to the source under ``root`` ("" if it can)."""
    path = root / mutant.file
    if not path.is_file():
        return f"{mutant.file} does not exist"
    n = occurrences(path.read_text(), mutant.original)
    if n != 1:
        return f"original text occurs {n} times in {mutant.file} (expected once)"
    return ""


def copy_tree(dest: pathlib.Path, tests_at: str | None) -> None:
    """The work tree's tracked and untracked (not ignored) files, copied to ``dest``; with
    ``tests_at``, ``tests/`` is replaced by the one at that commit."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src = ROOT / rel
        if not src.is_file():
            continue  # deleted but still tracked
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
    if tests_at:
        shutil.rmtree(dest / "tests", ignore_errors=True)
        archive = subprocess.run(
            ["git", "archive", tests_at, "tests"], cwd=ROOT, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def targets(mutant: Mutant, root: pathlib.Path, whole_files: bool, broad: bool) -> list[str]:
    """The pytest arguments for a mutant: its test ids, or the files holding them (then,
    with ``broad``, the module's broad files too: :data:`BROAD`)."""
    if not whole_files:
        return list(mutant.tests)
    files = []
    wanted = [t.split("::")[0] for t in mutant.tests]
    for file in [*wanted, *(BROAD.get(mutant.file, ()) if broad else ())]:
        if file not in files and (root / file).is_file():
            files.append(file)
    return files


_RUNNING: set[subprocess.Popen] = set()  # pytest processes to stop if the script is stopped


def pytest(root: pathlib.Path, args: list[str], python: str, timeout: float):
    """``python -m pytest args`` in ``root`` (its own process group, killed on timeout or
    when the script stops). Raises ``subprocess.TimeoutExpired``."""
    env = {
        **os.environ,
        "PYTHONPATH": str(root),
        "HYPOTHESIS_PROFILE": "ci",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    proc = subprocess.Popen(
        [python, "-m", "pytest", *PYTEST_ARGS, *args],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    _RUNNING.add(proc)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    finally:
        _stop(proc)
        _RUNNING.discard(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, "")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def baseline(mutants: list[Mutant], root: pathlib.Path, args: argparse.Namespace) -> str:
    """Runs every selected mutant's tests on the unmutated copy: "" if they pass, else the
    failures (a failing test would count every mutant it targets as caught)."""
    union: list[str] = []
    for m in mutants:
        if not stale_reason(m, root):
            for t in targets(m, root, args.whole_files or args.broad, args.broad):
                if t not in union:
                    union.append(t)
    if not union:
        return ""
    proc = pytest(root, union, args.python, 4 * args.timeout)
    if proc.returncode == 0:
        return ""
    failed = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return "\n".join(failed or proc.stdout.strip().splitlines()[-5:])


def run_mutant(mutant: Mutant, root: pathlib.Path, args: argparse.Namespace) -> Outcome:
    reason = stale_reason(mutant, root)
    if reason:
        return Outcome(mutant, "stale", detail=reason)
    test_args = targets(mutant, root, args.whole_files or args.broad, args.broad)
    if not test_args:
        return Outcome(mutant, "survived", detail="none of its test files exist")
    path = root / mutant.file
    original = path.read_text()
    path.write_text(original.replace(mutant.original, mutant.replacement))
    start = time.monotonic()
    try:
        proc = pytest(root, test_args, args.python, args.timeout)
    except subprocess.TimeoutExpired:
        return Outcome(mutant, "caught", time.monotonic() - start, "timed out")
    finally:
        path.write_text(original)
    seconds = time.monotonic() - start
    tail = proc.stdout.strip().splitlines()[-1:] or [""]
    if proc.returncode == 0:
        return Outcome(mutant, "survived", seconds, tail[0])
    if proc.returncode == 1:
        failed = [line for line in proc.stdout.splitlines() if line.startswith("FAILED")]
        return Outcome(mutant, "caught", seconds, (failed or tail)[0])
    return Outcome(mutant, "error", seconds, f"pytest exit {proc.returncode}: {tail[0]}")


def summary(outcomes: list[Outcome], title: str) -> str:
    counts = {s: sum(o.status == s for o in outcomes) for s in ("caught", "survived", "stale")}
    errors = sum(o.status == "error" for o in outcomes)
    ran = counts["caught"] + counts["survived"]
    score = 100.0 * counts["caught"] / ran if ran else 0.0
    lines = [
        f"# {title}",
        "",
        f"**{counts['caught']} of {ran} mutants caught ({score:.1f}%)**; "
        f"{counts['stale']} stale, {errors} in error.",
        "",
        "| mutant | file | status | seconds | detail |",
        "|---|---|---|---:|---|",
    ]
    for o in outcomes:
        detail = o.detail.replace("|", "\\|")[:120]
        lines.append(
            f"| {o.mutant.name} | {o.mutant.file.rsplit('/', 1)[-1]} | {o.status} | "
            f"{o.seconds:.0f} | {detail} |"
        )
    survivors = [o for o in outcomes if o.status == "survived"]
    if survivors:
        lines += ["", "## Survivors", ""]
        for o in survivors:
            why = o.mutant.survives or "UNEXPLAINED: add a test, or explain it in the list"
            lines.append(f"* **{o.mutant.name}** ({o.mutant.bug}): {why}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "-k", dest="select", default="", help="only mutants whose name matches this regex"
    )
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--check", action="store_true", help="only check the snippets")
    parser.add_argument("--tests-at", help="run tests/ as of this git revision")
    parser.add_argument(
        "--whole-files", action="store_true", help="run each mutant's whole test files"
    )
    parser.add_argument(
        "--broad",
        action="store_true",
        help="whole files plus the module's broad test files (BROAD)",
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the check that the mutants' tests pass on the unmutated copy",
    )
    parser.add_argument("-j", "--jobs", type=int, default=1, help="mutants run at once")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant")
    parser.add_argument("--python", default=sys.executable, help="interpreter running pytest")
    parser.add_argument("--out", default="runs/mutants.md", help="Markdown summary file")
    parser.add_argument(
        "--list-module",
        default="tools.mutant_list",
        help="module whose MUTANTS to run (a planted round: tools.mutants_round6)",
    )
    args = parser.parse_args(argv)

    listed = (  # by default the curated list and the planted rounds
        MUTANTS
        + importlib.import_module("tools.mutants_round6").MUTANTS
        + importlib.import_module("tools.mutants_round7").MUTANTS
        if args.list_module == "tools.mutant_list"
        else importlib.import_module(args.list_module).MUTANTS
    )
    mutants = [m for m in listed if re.search(args.select, m.name)]
    if args.list:
        for m in mutants:
            print(f"{m.name:40} {m.file:40} {m.bug}")
        return 0
    if args.check:
        stale = [(m, stale_reason(m, ROOT)) for m in mutants]
        stale = [(m, r) for m, r in stale if r]
        for m, reason in stale:
            print(f"stale: {m.name}: {reason}")
        print(f"{len(mutants) - len(stale)} of {len(mutants)} mutants apply")
        return 1 if stale else 0

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    outcomes: dict[str, Outcome] = {}
    jobs = max(1, args.jobs)
    with tempfile.TemporaryDirectory(prefix="jmp-mutants-") as tmp:
        roots = [pathlib.Path(tmp) / f"tree{i}" for i in range(jobs)]
        for root in roots:  # one copy per job: a mutant is applied to its own copy
            copy_tree(root, args.tests_at)
        if not args.no_baseline:
            print("baseline: the mutants' tests on the unmutated copy ...", flush=True)
            start = time.monotonic()
            failures = baseline(mutants, roots[0], args)
            print(f"baseline: {time.monotonic() - start:.0f}s", flush=True)
            if failures:
                print(f"the unmutated copy fails its tests; no mutant run:\n{failures}")
                return 1
        free = list(roots)
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:

            def work(mutant: Mutant) -> Outcome:
                root = free.pop()
                try:
                    return run_mutant(mutant, root, args)
                finally:
                    free.append(root)

            futures = [pool.submit(work, m) for m in mutants]
            try:
                for done in concurrent.futures.as_completed(futures):
                    outcome = done.result()
                    outcomes[outcome.mutant.name] = outcome
                    print(
                        f"[{len(outcomes)}/{len(mutants)}] {outcome.status:8} "
                        f"{outcome.mutant.name} ({outcome.seconds:.0f}s) "
                        f"{outcome.detail[:100]}",
                        flush=True,
                    )
            except BaseException:  # stopped (Ctrl-C, SIGTERM): stop the tests too
                for future in futures:
                    future.cancel()
                for proc in list(_RUNNING):
                    _stop(proc)
                raise
    ordered = [outcomes[m.name] for m in mutants]
    scope = (
        "whole test files and the module's broad files"
        if args.broad
        else "whole test files"
        if args.whole_files
        else "targeted tests"
    )
    suite = f"tests/ at {args.tests_at}" if args.tests_at else "the work tree's tests"
    text = summary(ordered, f"Mutation score: {suite}, {scope}")
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    bad = [o for o in ordered if o.status in ("stale", "error")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
