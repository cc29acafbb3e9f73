"""Entry point of the bundled app: ``Longleaf [--self-test] [--model M] [files...]``.

``--self-test`` is answered here before the GUI is imported, so a broken bundle
reports what is missing instead of failing to draw a window.
"""

from __future__ import annotations

import sys


def main() -> int:
    if "--self-test" in sys.argv[1:]:
        from app.self_test import main as self_test

        return self_test(sys.argv[1:])
    from app.__main__ import main as run_app

    return run_app()


if __name__ == "__main__":
    raise SystemExit(main())
