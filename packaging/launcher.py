"""Entry point of the bundled app: ``Longleaf [--self-test] [--model M] [files...]``.

``--self-test`` is answered here before the GUI is imported, so a broken bundle
reports what is missing instead of failing to draw a window. ``Longleaf -m
MODULE ARGS...`` runs a module as ``python -m`` does: the bundle's executable is
the only Python the app has, and the pipeline starts its launcher, its ranks and
the host check that way (``sys.executable -m ...``).
"""

from __future__ import annotations

import runpy
import sys


def main() -> int:
    if sys.argv[1:2] == ["-m"] and len(sys.argv) > 2:
        module, sys.argv = sys.argv[2], sys.argv[2:]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    if "--self-test" in sys.argv[1:]:
        from app.self_test import main as self_test

        return self_test(sys.argv[1:])
    from app.__main__ import main as run_app

    return run_app()


if __name__ == "__main__":
    raise SystemExit(main())
