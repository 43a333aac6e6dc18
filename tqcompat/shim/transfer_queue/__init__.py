"""``transfer_queue`` for every process that has this folder's parent on its path: the opt-in
that reaches subprocesses and Ray workers (they inherit ``PYTHONPATH``)::

    export PYTHONPATH="$(python -m tqcompat --shim-path)${PYTHONPATH:+:$PYTHONPATH}"

On import it installs the alias (:mod:`tqcompat.alias`) and puts the facade in its own place
in ``sys.modules``; a real TransferQueue installed too is named on stderr, hidden in this
process because the path was set on purpose.
"""

import sys

from tqcompat.alias import install_from_shim

sys.modules[__name__] = install_from_shim(__file__)
