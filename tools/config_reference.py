"""Rewrite the README's configuration reference from the config keys' declarations.

    python tools/config_reference.py           # rewrite the tables between the README's markers
    python tools/config_reference.py --check   # exit 1 when the README is not up to date

Each key is declared once, beside its field (``torchrig.config.key``); ``torchrig config`` prints the
same reference in the terminal.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def main() -> int:
    import torchrig.recipes  # noqa: F401  (registers the recipes' sections)
    from torchrig.config.reference import with_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say whether the README is up to date")
    args = parser.parse_args()
    text = README.read_text()
    new = with_table(text)
    if args.check:
        print("README.md: configuration reference up to date" if new == text else
              "README.md: configuration reference out of date; run python tools/config_reference.py")
        return 0 if new == text else 1
    README.write_text(new)
    print(f"wrote the configuration reference of {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
