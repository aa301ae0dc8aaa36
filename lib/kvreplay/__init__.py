"""kvreplay: reproduce and extend *Stage-Replay Divergence Follows the KV Cache*.

Every notebook calls into this package. Each module is one concept and imports
only the layers below it (docs/ARCHITECTURE.md, which a test keeps true): the
core (``paths``, ``contract``, ``execution``, ``models``, ``problems``, ``bank``, ``decode``,
``caches``, ``engine``, ``gates``, ``drift``, ``scoring``, ``stats``),
``ledger`` (append-only, resumable results and their lookup by provenance),
``runner`` (arm settings, the run loop, Ray row actors), ``experiments`` (one
module per experiment) with ``adapt`` (the checkpoint family), ``report``
(tables and figures from ledgers) with ``rebuild`` (one row's caches for
inspection), the notebooks' glue (``profiles``, ``session``, ``explorer``)
and the command lines ``paper``, ``bench``, ``probe`` and ``verify``.
"""

__version__ = "0.1.0"
