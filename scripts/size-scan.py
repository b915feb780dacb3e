#!/usr/bin/env python3
"""Production files over 600 lines and production functions over 80 lines.

Usage: scripts/size-scan.py [DIR...]   (default: the product's crates)

A file's production part ends at its `#[cfg(test)]` module; a function is measured from the
line of its `fn` to its closing brace (comments and strings are skipped when matching braces).
Exits 1 when something is over, listing it; lookup tables (a `match` whose every arm is one
line) are exempted by name in LOOKUP_TABLES.
"""

import pathlib
import re
import sys

FILE_LIMIT = 600
FUNCTION_LIMIT = 80
CRATES = ["api/src", "operator/src", "store/src", "telemetry/src", "worker/src"]
# Functions that are lookup tables: one arm per line, long because the table is.
LOOKUP_TABLES: set[str] = set()

FN = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?fn\s+(\w+)")


def production_lines(path: pathlib.Path) -> list[str]:
    lines = path.read_text().splitlines()
    for index, line in enumerate(lines):
        if line.startswith("#[cfg(test)]"):
            return lines[:index]
    return lines


TOKENS = re.compile(
    r'//[^\n]*|/\*.*?\*/|b?r(#*)".*?"\1|b?"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\\n])\'',
    re.DOTALL,
)


def blank(lines: list[str]) -> list[str]:
    """The lines with comments, strings and char literals emptied (newlines kept)."""
    text = TOKENS.sub(lambda m: "\n" * m.group(0).count("\n"), "\n".join(lines))
    return text.split("\n")


def functions(lines: list[str]):
    lines = blank(lines)
    index = 0
    while index < len(lines):
        match = FN.match(lines[index])
        if not match:
            index += 1
            continue
        depth, opened, end = 0, False, index
        for end in range(index, len(lines)):
            text = lines[end]
            if not opened and ";" in text and "{" not in text:
                break  # a declaration without a body (trait method)
            depth += text.count("{") - text.count("}")
            opened = opened or "{" in text
            if opened and depth <= 0:
                break
        if opened:
            yield match.group(1), index + 1, end - index + 1
        index += 1


def main() -> int:
    roots = sys.argv[1:] or CRATES
    over = []
    for root in roots:
        root = pathlib.Path(root)
        paths = [root] if root.is_file() else sorted(root.rglob("*.rs"))
        for path in paths:
            lines = production_lines(path)
            if len(lines) > FILE_LIMIT:
                over.append(f"{path}: {len(lines)} production lines (limit {FILE_LIMIT})")
            for name, line, length in functions(lines):
                if length > FUNCTION_LIMIT and name not in LOOKUP_TABLES:
                    over.append(f"{path}:{line}: fn {name} is {length} lines (limit {FUNCTION_LIMIT})")
    for item in over:
        print(item)
    print(f"{len(over)} over the limits", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
