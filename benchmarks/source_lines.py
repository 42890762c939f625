"""The lines of a source tree by what they hold: code, docstrings, comments
and blank lines, counted with the standard library's ``ast`` (docstrings)
and ``tokenize`` (comments, blank lines).

::

    python benchmarks/source_lines.py [FOLDER ...]   # mlx_pinned/server by default
    python benchmarks/source_lines.py --rev REV      # the same, at a git revision

A line is a docstring's if it is part of a module's, class's or function's
docstring; a comment's if it holds only a comment; blank if it holds
nothing; code otherwise (a line with code and a comment is code).
"""

from __future__ import annotations

import argparse
import ast
import io
import subprocess
import tokenize
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def classify(source: str) -> Counter[str]:
    """Each line of ``source``, counted by kind."""
    lines = source.splitlines()
    kinds = ["code"] * len(lines)
    for number, line in enumerate(lines):
        if not line.strip():
            kinds[number] = "blank"
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row = token.start[0] - 1
            if lines[row].strip().startswith("#"):
                kinds[row] = "comment"
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if not isinstance(body, list) or not body:
            continue
        first = body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            if isinstance(first.value.value, str) and isinstance(
                node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
            ):
                assert first.end_lineno is not None
                for row in range(first.lineno - 1, first.end_lineno):
                    kinds[row] = "docstring"
    return Counter(kinds)


def sources(folders: list[str], rev: str | None) -> list[str]:
    """The text of every ``.py`` file under ``folders`` (at ``rev``)."""
    if rev is None:
        return [
            path.read_text()
            for folder in folders
            for path in sorted((ROOT / folder).rglob("*.py"))
        ]
    names = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", rev, "--", *folders],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [
        subprocess.run(
            ["git", "show", f"{rev}:{name}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for name in names
        if name.endswith(".py")
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*", default=["mlx_pinned/server"])
    parser.add_argument("--rev", help="a git revision (default: the work tree)")
    args = parser.parse_args()
    total: Counter[str] = Counter()
    texts = sources(args.folders, args.rev)
    for text in texts:
        total += classify(text)
    lines = sum(total.values())
    print(f"{len(texts)} modules, {lines} lines")
    for kind in ("code", "docstring", "comment", "blank"):
        print(f"  {kind:<9} {total[kind]:>6}  {100 * total[kind] / lines:5.1f} %")


if __name__ == "__main__":
    main()
