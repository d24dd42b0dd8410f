"""Every ```python block of README.md and of the documentation's pages (``docs/**/*.md``) runs
as written, each on its own in a fresh interpreter; and the API reference has an entry for
every public name.

A block is a user's copy-paste: it must define everything it uses. It runs as a script from
an empty directory, with the repository on ``PYTHONPATH`` (JAX on CPU, without the suite's
tracer-leak checking, which disables JAX's caches). A block may be left out only by an HTML
comment on the line right before its opening fence, with a reason:

    <!-- readme-test: skip (needs a GPU) -->

What a block prints is checked where the reader reads it: a block right after a python block,
marked by the comment on the line before its fence,

    <!-- readme-test: output -->

is that block's expected output. Its lines must appear in what the block prints, in order and
whole (trailing spaces aside); ``...`` inside a line stands for any text (figures that differ
between JAX versions), and a line that is only ``...`` for any number of lines.

Any other ``<!-- readme-test ... -->`` comment is an error, so a misspelt marker cannot hide a
block (and cannot silently fail to skip one). The markers are the same in the README and in
the documentation, so a passage moves between them unchanged; a block that appears in both
(the Example, on the README and on the site's home page) runs once, and what each place shows
after it is checked against that one run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import jmp_rewrite

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO, "docs")

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_SKIP = re.compile(r"^\s*<!--\s*readme-test:\s*skip\s*\((?P<reason>[^()]*\S[^()]*)\)\s*-->\s*$")
_OUTPUT = re.compile(r"^\s*<!--\s*readme-test:\s*output\s*-->\s*$")
_PYTHON = {"python", "py", "python3"}


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown document."""

    line: int  # 1-based line of the opening fence
    heading: str  # the section it sits in
    language: str
    code: str
    skip: str | None  # the reason, when marked to skip
    expect: str | None = None  # the output the page shows for it (the next, marked block)


def parse_blocks(text: str, name: str = "README.md") -> list[Block]:
    """The fenced code blocks of a Markdown document (``name`` in messages), with their skip
    and output markers.

    Raises:
      ValueError: for an unclosed fence, a malformed ``readme-test`` comment, or a skip
        marker that does not sit right before a python block.
    """
    lines = text.splitlines()
    blocks, heading, i = [], "top", 0
    while i < len(lines):
        line = lines[i]
        if (
            line.lstrip().startswith("<!--")
            and "readme-test" in line
            and not (_SKIP.match(line) or _OUTPUT.match(line))
        ):
            raise ValueError(
                f"{name}:{i + 1}: malformed marker {line.strip()!r}; the markers are "
                "'<!-- readme-test: skip (reason) -->' right before a ```python fence and "
                "'<!-- readme-test: output -->' right before the fence of its output"
            )
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        match = _FENCE.match(line)
        if not match:
            i += 1
            continue
        fence, indent = match["fence"], match["indent"]
        language = match["info"].strip().split(" ")[0].lower() if match["info"].strip() else ""
        closing = re.compile(f"{re.escape(fence[0])}{{{len(fence)},}}")
        end = next(
            (j for j in range(i + 1, len(lines)) if closing.fullmatch(lines[j].strip())), None
        )
        if end is None:
            raise ValueError(f"{name}:{i + 1}: unclosed code fence")
        body = [ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines[i + 1 : end]]
        previous = lines[i - 1] if i else ""
        skip = _SKIP.match(previous)
        if skip and language not in _PYTHON:
            raise ValueError(f"{name}:{i}: skip marker before a {language or 'plain'} block")
        code = textwrap.dedent("\n".join(body)) + "\n"
        if _OUTPUT.match(previous):
            if not blocks or blocks[-1].language not in _PYTHON or blocks[-1].skip:
                raise ValueError(f"{name}:{i}: output marker after no python block that runs")
            if blocks[-1].expect is not None:
                raise ValueError(f"{name}:{i}: a second output for one python block")
            blocks[-1] = dataclasses.replace(blocks[-1], expect=code)
        else:
            blocks.append(Block(i + 1, heading, language, code, skip["reason"] if skip else None))
        i = end + 1
    for j, line in enumerate(lines):
        marked = _SKIP.match(line) or _OUTPUT.match(line)
        if marked and not (j + 1 < len(lines) and _FENCE.match(lines[j + 1])):
            raise ValueError(f"{name}:{j + 1}: marker not right before a code fence")
    return blocks


def _package_smoke():
    """``tools/package_smoke.py``, whose ``missing_output`` is the rule for outputs (the
    installed package's smoke test runs it without the checkout: it cannot import ours)."""
    path = Path(__file__).resolve().parent.parent / "tools" / "package_smoke.py"
    spec = importlib.util.spec_from_file_location("tools.package_smoke", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: The first expected line not found in order in the printed text, or None when all are:
#: ``missing_output("a ...\n...\nc", "a 1\nb\nc")`` is None.
missing_output = _package_smoke().missing_output


def documents() -> list[str]:
    """README.md and every Markdown page of the documentation, relative to the repository."""
    pages = []
    for root, dirs, files in os.walk(DOCS):
        dirs[:] = sorted(d for d in dirs if not d.startswith("_") and d != "notebooks")
        pages += [os.path.join(root, f) for f in sorted(files) if f.endswith(".md")]
    return ["README.md"] + [os.path.relpath(p, REPO) for p in pages]


@dataclasses.dataclass(frozen=True)
class Place:
    """Where a block appears: the document, its line, its section and what it shows after it."""

    document: str
    line: int
    heading: str
    expect: str | None
    skip: str | None


@dataclasses.dataclass(frozen=True)
class Code:
    """One python block's code, with every place it appears (the same code runs once)."""

    code: str
    places: tuple[Place, ...]

    @property
    def skip(self) -> str | None:
        """The skip reason when every place skips it (one place that runs it is enough)."""
        reasons = [p.skip for p in self.places]
        return None if None in reasons else reasons[0]


def _python_blocks() -> list[Code]:
    places: dict[str, list[Place]] = {}
    for document in documents():
        with open(os.path.join(REPO, document), encoding="utf-8") as f:
            for b in parse_blocks(f.read(), document):
                if b.language in _PYTHON:
                    place = Place(document, b.line, b.heading, b.expect, b.skip)
                    places.setdefault(b.code, []).append(place)
    return [Code(code, tuple(where)) for code, where in places.items()]


def _block_id(block: Code) -> str:
    first = block.places[0]
    page = os.path.splitext(first.document.removeprefix("docs" + os.sep))[0].replace(os.sep, "/")
    slug = re.sub(r"[^a-z0-9]+", "-", first.heading.lower()).strip("-")
    return f"{page}-L{first.line}-{slug}"


BLOCKS = _python_blocks()


def _where(place: Place) -> str:
    return f"{place.document}:{place.line} ({place.heading})"


def test_documents_have_python_blocks():
    assert any(p.document == "README.md" for b in BLOCKS for p in b.places), "README has none"
    assert len({p.document for b in BLOCKS for p in b.places}) > 5, "the guides have none"
    skipped = [b for b in BLOCKS if b.skip]
    assert len(skipped) <= len(BLOCKS) // 2, "skip markers are for the exception"


@pytest.mark.once  # public API only: `make test` runs it, `make test-newest` need not
@pytest.mark.parametrize("block", BLOCKS, ids=[_block_id(b) for b in BLOCKS])
def test_block_runs(block, tmp_path):
    if block.skip:
        pytest.skip(f"{_where(block.places[0])}: {block.skip}")
    script = tmp_path / f"block_l{block.places[0].line}.py"
    script.write_text(block.code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "JAX_CHECK_TRACER_LEAKS"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,  # a hang guard only: no test depends on how fast the machine is
    )
    assert proc.returncode == 0, (
        f"{_where(block.places[0])} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )
    for place in block.places:
        if place.expect is not None:
            missing = missing_output(place.expect, proc.stdout)
            assert missing is None, (
                f"{_where(place)} does not print what the page shows after it; missing (in "
                f"order): {missing!r}\nprinted:\n{proc.stdout[-3000:]}"
            )


def test_the_first_example_shows_its_output():
    """Issue 16: the README's first example printed a report saying the rewrite did nothing;
    what it prints is now shown under it and checked. The site's home page shows the same."""
    example = next(b for b in BLOCKS if any(p.heading == "Example" for p in b.places))
    shown = {p.document: p.expect for p in example.places}
    assert {"README.md", os.path.join("docs", "index.md")} <= set(shown)
    assert all(e and "FLOPs in half precision: 99.6%" in e for e in shown.values())


def test_blocks_in_two_places_run_once():
    assert len({b.code for b in BLOCKS}) == len(BLOCKS)
    assert any(len(b.places) > 1 for b in BLOCKS)


# --------------------------------------------------------------------------------------------
# The API reference: one entry per public name.

_ENTRY = re.compile(
    r"^\.\. auto(?:function|class|data|exception):: jmp_rewrite\.(?P<auto>\w+)(?:\(.*\))?\s*$"
    r"|^```\{py:(?:function|class|data|exception)\} (?:jmp_rewrite\.)?(?P<manual>\w+)",
    re.M,
)


def reference_entries() -> list[str]:
    """The public names that docs/api/*.md documents, once per entry."""
    names = []
    for page in sorted(os.listdir(os.path.join(DOCS, "api"))):
        if page.endswith(".md"):
            with open(os.path.join(DOCS, "api", page), encoding="utf-8") as f:
                names += [m["auto"] or m["manual"] for m in _ENTRY.finditer(f.read())]
    return names


def test_every_public_name_has_one_reference_entry():
    entries = reference_entries()
    missing = sorted(set(jmp_rewrite.__all__) - set(entries))
    assert not missing, f"public names without an entry in docs/api/*.md: {missing}"
    stale = sorted(set(entries) - set(jmp_rewrite.__all__))
    assert not stale, f"docs/api/*.md documents names that are not public: {stale}"
    twice = sorted({n for n in entries if entries.count(n) > 1})
    assert not twice, f"documented twice: {twice}"


def test_reference_entry_pattern():
    text = (
        ".. autofunction:: jmp_rewrite.rewrite\n```{py:data} LEVELS\n.. autoclass:: x.Y\n"
        ".. autofunction:: jmp_rewrite.paint(fun, *args, dtype)\n"
    )
    names = [m["auto"] or m["manual"] for m in _ENTRY.finditer(text)]
    assert names == ["rewrite", "LEVELS", "paint"]


def test_benchmark_plots_find_their_tables(tmp_path):
    """The Benchmarks page's plots are drawn from its tables: a table edited out of shape
    fails here (and in `make docs`), not as a stale plot."""
    sys.path.insert(0, os.path.join(DOCS, "_ext"))
    try:
        import benchmark_plots
    finally:
        sys.path.pop(0)
    benchmark_plots.main(DOCS, str(tmp_path))
    drawn = sorted(p.name for p in tmp_path.iterdir())
    assert len(drawn) == 6 and all(p.stat().st_size > 10_000 for p in tmp_path.iterdir()), drawn
    rows = benchmark_plots.table(
        [t for page in benchmark_plots.PAGES for t in _tables(benchmark_plots, page)],
        "model",
        "f32 TF32",
    )
    assert rows[1][0] == "GPT-2 small" and benchmark_plots.first(rows[1][1]) == 683.4
    assert benchmark_plots.numbers("108.8 / 110.4") == [108.8, 110.4]
    assert benchmark_plots.numbers("7.9% (`nnx.Embed(dtype=bf16)`)") == [7.9]


def _tables(module, page: str) -> list:
    with open(os.path.join(DOCS, page), encoding="utf-8") as f:
        return module.tables(f.read())


# --------------------------------------------------------------------------------------------
# The parser itself.

SAMPLE = """\
# Title

```sh
make test
```

## Usage

```python
print(1)
```

<!-- readme-test: skip (needs a GPU) -->
```python
print(2)
```

- a list item:

  ```py
  if True:
      print(3)
  ```

````python
```
````
"""


def test_output_blocks_attach_to_the_python_block_before_them():
    text = "```python\nprint(1)\n```\n\n<!-- readme-test: output -->\n```text\n1\n```\n"
    (block,) = parse_blocks(text)
    assert block.code == "print(1)\n" and block.expect == "1\n"
    with pytest.raises(ValueError, match="output marker after no python block"):
        parse_blocks("```sh\nls\n```\n<!-- readme-test: output -->\n```text\nx\n```\n")


@pytest.mark.parametrize(
    ("expect", "printed", "missing"),
    [
        ("a\nc", "a\nc\n", None),
        ("a\nc", "a\nb\nc\n", "c"),  # lines follow each other unless "..." is between
        ("a\n...\nc", "a\nb\nc\n", None),
        ("loss ..., scale 2", "loss 0.93, scale 2", None),
        ("loss ..., scale 2", "loss 0.93, scale 4", "loss ..., scale 2"),
        ("x", "x y", "x"),  # whole lines
    ],
)
def test_missing_output(expect, printed, missing):
    assert missing_output(expect, printed) == missing


def test_parse_blocks_finds_languages_skips_and_indented_blocks():
    blocks = parse_blocks(SAMPLE)
    assert [(b.line, b.heading, b.language, b.skip) for b in blocks] == [
        (3, "Title", "sh", None),
        (9, "Usage", "python", None),
        (14, "Usage", "python", "needs a GPU"),
        (20, "Usage", "py", None),
        (25, "Usage", "python", None),
    ]
    assert blocks[3].code == "if True:\n    print(3)\n"
    assert blocks[4].code == "```\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<!-- readme-test: skip -->\n```python\nx\n```\n", "malformed marker"),
        ("<!-- readme-test: skp (why) -->\n```python\nx\n```\n", "malformed marker"),
        ("<!-- readme-test: skip (why) -->\n\n```python\nx\n```\n", "not right before"),
        ("<!-- readme-test: skip (why) -->\n```sh\nx\n```\n", "before a sh block"),
        ("```python\nx\n", "unclosed code fence"),
    ],
)
def test_parse_blocks_rejects_bad_markers(text, message):
    with pytest.raises(ValueError, match=message):
        parse_blocks(text)
