"""Run code written for ``import transfer_queue`` on this store (see :mod:`tqcompat.alias`):

python -m tqcompat script.py [args]
python -m tqcompat -m package.module [args]
python -m tqcompat --shim-path     # the folder to put on PYTHONPATH for every process
"""

from __future__ import annotations

import os
import runpy
import sys

from tqcompat.alias import SHIM_PATH, install


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if args else 2)
    if args[0] == "--shim-path":
        print(SHIM_PATH)
        return
    install(force=os.environ.get("TQ_COMPAT_FORCE") == "1")
    if args[0] == "-m":
        if len(args) < 2:
            raise SystemExit("python -m tqcompat -m needs a module name")
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return
    sys.argv = list(args)
    runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
