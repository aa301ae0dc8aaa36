"""kvreplay: reproduce and extend *Stage-Replay Divergence Follows the KV Cache*.

Every notebook calls into this package. Each module is one concept and imports
only the layers below it (docs/ARCHITECTURE.md, which a test keeps true). The
core is ``paths``, ``contract``, ``execution``, ``models``, ``problems``, ``bank``, ``decode``,
``caches``, ``engine``, ``gates``, ``drift``, ``scoring`` and ``stats``. Above it sit
``ledger`` (append-only, resumable results and their lookup by provenance) and
``runner`` (arm settings, the run loop, Ray row actors). Then come ``experiments`` (one
module per experiment) with ``adapt`` (the checkpoint family), and ``report``
(tables and figures from ledgers) with ``rebuild`` (one row's caches for
inspection). On top are the notebooks' glue (``profiles``, ``session``, ``explorer``)
and the command lines ``paper``, ``bench``, ``probe`` and ``verify``.

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
