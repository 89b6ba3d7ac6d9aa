"""Writes docs/environment.md from bimetal/env.py's table (``--check``: exit 1 when the page differs instead)."""

from __future__ import annotations

import sys
from pathlib import Path

from bimetal.env import reference_page

PAGE = Path(__file__).resolve().parent.parent / "docs" / "environment.md"


def main(argv: list[str]) -> int:
    text = reference_page()
    if argv == ["--check"]:
        if PAGE.exists() and PAGE.read_text() == text:
            return 0
        print(f"{PAGE} differs from bimetal/env.py; run: python scripts/env_page.py", file=sys.stderr)
        return 1
    if argv:
        print("usage: python scripts/env_page.py [--check]", file=sys.stderr)
        return 2
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
