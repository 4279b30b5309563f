"""docs/reference/errors.md stays true to the code: every phrase it lists occurs in a message under
src/zbpipe, and every error message raised with a literal text under src/zbpipe is listed there.

Format read from docs/reference/errors.md: each markdown table whose header's first cell is
``message``;
in each data row the first cell holds one phrase in backticks. ``{}`` in a phrase stands for a
run-time value (an f-string replacement field); ``\\|`` is a ``|`` escaped for the table.
Messages are compared as the code's string literals, with adjacent literals joined and each
f-string field rendered as ``{}``, so a phrase may span the lines of an implicitly joined string.
No processes, no torch: pure ``ast`` over the source files.
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "zbpipe"
DOC = ROOT / "docs" / "reference" / "errors.md"

#: exception types whose literal messages must be documented
CHECKED = {"ValueError", "RuntimeError", "PlanError", "ImportError", "TypeError"}


def render(node: ast.AST) -> str | None:
    """A string literal as text, f-string fields as ``{}``; None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def source_literals(src: Path) -> list[str]:
    """Every string literal in the package's Python files, rendered."""
    out = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            text = render(node)
            if text is not None:
                out.append(text)
    return out


def raised_messages(src: Path) -> list[tuple[str, str]]:
    """``(where, text)`` for each ``raise Checked(<literal>, ...)`` in the package."""
    out = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            func = node.exc.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name not in CHECKED or not node.exc.args:
                continue
            text = render(node.exc.args[0])
            if text is not None:
                out.append((f"{path.relative_to(src.parent)}:{node.lineno}", text))
    return out


def doc_phrases(doc_text: str) -> list[str]:
    """The stable phrases of docs/reference/errors.md (first cell of every row of a ``message``
    table)."""
    phrases = []
    in_table = False
    for line in doc_text.splitlines():
        cells = (
            [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if line.startswith("|")
            else None
        )
        if cells is None:
            in_table = False
            continue
        if cells[0] == "message":
            in_table = True
            continue
        if not in_table or set(cells[0]) <= {"-", ":"}:
            continue
        spans = re.findall(r"`([^`]+)`", cells[0])
        assert len(spans) == 1, f"errors.md: a message cell must hold exactly one `phrase`: {line}"
        phrases.append(spans[0].replace("\\|", "|"))
    return phrases


def missing_phrases(phrases: list[str], src: Path) -> list[str]:
    literals = source_literals(src)
    return [p for p in phrases if not any(p in lit for lit in literals)]


PHRASES = doc_phrases(DOC.read_text())


def test_the_doc_lists_many_phrases_and_no_duplicates():
    # A format change that silently makes the parser find nothing must fail here.
    assert len(PHRASES) >= 100, len(PHRASES)
    dup = {p for p in PHRASES if PHRASES.count(p) > 1}
    assert not dup, f"listed twice in docs/reference/errors.md: {sorted(dup)}"


def test_every_listed_phrase_occurs_in_the_source():
    missing = missing_phrases(PHRASES, SRC)
    assert not missing, (
        "docs/reference/errors.md lists messages no longer in src/zbpipe (update the rows): "
        + "; ".join(missing)
    )


def test_every_raised_message_is_listed():
    undocumented = [
        f"{where}: {text[:90]!r}"
        for where, text in raised_messages(SRC)
        if not any(p in text for p in PHRASES)
    ]
    assert not undocumented, "add these messages to docs/reference/errors.md:\n" + "\n".join(
        undocumented
    )


def test_removing_a_phrase_from_the_code_is_detected(tmp_path):
    # The checker itself, on a copy of the package with one documented message reworded.
    copy = tmp_path / "zbpipe"
    shutil.copytree(SRC, copy)
    phrase = "pipeline ranks disagree on the schedule configuration"
    assert phrase in PHRASES
    target = copy / "observe" / "agree.py"
    target.write_text(target.read_text().replace(phrase, "ranks differ"))
    # Compared with the untouched package, so this test checks the checker even when the
    # package itself currently misses a phrase (test_every_listed_phrase_... reports that).
    assert set(missing_phrases(PHRASES, copy)) - set(missing_phrases(PHRASES, SRC)) == {phrase}


@pytest.mark.parametrize(
    "cell, expected",
    [
        ("| `a {} b` | ValueError | c | d |", ["a {} b"]),
        ("| `x \\| y` | PlanError | c | d |", ["x | y"]),
    ],
)
def test_the_row_format(cell, expected):
    doc = "| message | type | cause | fix |\n|---|---|---|---|\n" + cell + "\n"
    assert doc_phrases(doc) == expected
