"""``python -m tqcompat script.py [args]``: run a script written for ``import transfer_queue``
on this store (see :mod:`tqcompat.alias`)."""

from __future__ import annotations

import os
import runpy
import sys

from tqcompat.alias import install


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if args else 2)
    install(force=os.environ.get("TQ_COMPAT_FORCE") == "1")
    sys.argv = list(args)
    runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
