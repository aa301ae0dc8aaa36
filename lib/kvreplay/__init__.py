"""kvreplay: reproduce and extend *Stage-Replay Divergence Follows the KV Cache*.

Every notebook calls into this package. Each folder is one layer of concepts and imports
only the layers below it (docs/ARCHITECTURE.md, which a test keeps true). At the root sit ``paths``,
``arm_facts`` and ``gates``; then ``data`` (the problems and the bank) and ``analysis`` (statistics,
scoring, drift); ``model`` (loading under the execution contract, the invariant kernels); ``decoding``
(the block contract, the tie rule, the constructions and the suffix decoder, replicas); ``engine`` (the
batched decoder). Above them sit ``ledger`` (append-only, resumable results and their lookup by provenance)
and ``runner`` (arm settings, the run loop, Ray row actors). Then come ``experiments`` (one module per
experiment) with ``adapt`` (the checkpoint family), and ``report`` (tables, figures, one row's caches
rebuilt for inspection). On top are the notebooks' glue (``notebook``) and the command lines ``paper``,
``bench``, ``probe`` and ``verify``.
Importing the package sets the thread policy of every entry point (``python -m kvreplay.…``, a notebook kernel,
the explorer) before torch loads: ``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it. OpenMP reads it once,
when torch loads its runtime; idle threads then sleep instead of spinning, which on a shared or busy machine keeps a
row from running many times slower. It changes no bit. Import ``kvreplay`` before ``torch`` for it to apply.
"""

import os as _os

WAIT_POLICY = "OMP_WAIT_POLICY"
"""The OpenMP setting the package sets before torch loads, when the environment leaves it unset."""

_os.environ.setdefault(WAIT_POLICY, "PASSIVE")

__version__ = "0.1.0"
