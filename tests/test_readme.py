"""Every ```python block of README.md runs as written, each on its own in a fresh interpreter.

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
block (and cannot silently fail to skip one).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_SKIP = re.compile(r"^\s*<!--\s*readme-test:\s*skip\s*\((?P<reason>[^()]*\S[^()]*)\)\s*-->\s*$")
_OUTPUT = re.compile(r"^\s*<!--\s*readme-test:\s*output\s*-->\s*$")
_PYTHON = {"python", "py", "python3"}


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block of the README."""

    line: int  # 1-based line of the opening fence
    heading: str  # the section it sits in
    language: str
    code: str
    skip: str | None  # the reason, when marked to skip
    expect: str | None = None  # the output the README shows for it (the next, marked block)


def parse_blocks(text: str) -> list[Block]:
    """The fenced code blocks of a Markdown document, with their skip markers.

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
                f"README.md:{i + 1}: malformed marker {line.strip()!r}; the markers are "
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
            raise ValueError(f"README.md:{i + 1}: unclosed code fence")
        body = [ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines[i + 1 : end]]
        previous = lines[i - 1] if i else ""
        skip = _SKIP.match(previous)
        if skip and language not in _PYTHON:
            raise ValueError(f"README.md:{i}: skip marker before a {language or 'plain'} block")
        code = textwrap.dedent("\n".join(body)) + "\n"
        if _OUTPUT.match(previous):
            if not blocks or blocks[-1].language not in _PYTHON or blocks[-1].skip:
                raise ValueError(f"README.md:{i}: output marker after no python block that runs")
            if blocks[-1].expect is not None:
                raise ValueError(f"README.md:{i}: a second output for one python block")
            blocks[-1] = dataclasses.replace(blocks[-1], expect=code)
        else:
            blocks.append(Block(i + 1, heading, language, code, skip["reason"] if skip else None))
        i = end + 1
    for j, line in enumerate(lines):
        marked = _SKIP.match(line) or _OUTPUT.match(line)
        if marked and not (j + 1 < len(lines) and _FENCE.match(lines[j + 1])):
            raise ValueError(f"README.md:{j + 1}: marker not right before a code fence")
    return blocks


def missing_output(expect: str, printed: str) -> str | None:
    """The first expected line not found in order in ``printed``, or None when all are.

    Example: ``missing_output("a ...\n...\nc", "a 1\nb\nc")`` is None.
    """
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


def _python_blocks() -> list[Block]:
    with open(README, encoding="utf-8") as f:
        return [b for b in parse_blocks(f.read()) if b.language in _PYTHON]


def _block_id(block: Block) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", block.heading.lower()).strip("-")
    return f"L{block.line}-{slug}"


BLOCKS = _python_blocks()


def test_readme_has_python_blocks():
    assert BLOCKS, "README.md has no ```python blocks"
    skipped = [b for b in BLOCKS if b.skip]
    assert len(skipped) <= len(BLOCKS) // 2, "skip markers are for the exception"


@pytest.mark.once  # public API only: `make test` runs it, `make test-newest` need not
@pytest.mark.parametrize("block", BLOCKS, ids=[_block_id(b) for b in BLOCKS])
def test_readme_block_runs(block, tmp_path):
    if block.skip:
        pytest.skip(f"README.md:{block.line}: {block.skip}")
    script = tmp_path / f"readme_l{block.line}.py"
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
        f"README.md:{block.line} ({block.heading}) failed:\n{proc.stdout[-2000:]}\n"
        f"{proc.stderr[-4000:]}"
    )
    if block.expect is not None:
        missing = missing_output(block.expect, proc.stdout)
        assert missing is None, (
            f"README.md:{block.line} ({block.heading}) does not print what the README shows "
            f"after it; missing (in order): {missing!r}\nprinted:\n{proc.stdout[-3000:]}"
        )


def test_the_first_example_shows_its_output():
    """Issue 16: the README's first example printed a report saying the rewrite did nothing;
    what it prints is now shown under it and checked."""
    example = next(b for b in BLOCKS if b.heading == "Example")
    assert example.expect and "FLOPs in half precision: 99.6%" in example.expect


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
