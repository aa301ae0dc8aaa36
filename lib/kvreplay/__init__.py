"""kvreplay: reproduce and extend *Stage-Replay Divergence Follows the KV Cache*.

The package is thin; every notebook calls into it. One concern per module:
``contract`` (blocks, roles, visibility, structural mask), ``models``
(loading, precision, execution contract), ``decode`` (live multi-branch
generator and the shared suffix decoder), ``caches`` (live, incremental,
prefill, replicas, transplants), ``gates`` (fail-closed integrity gates),
``drift`` (per-tensor summaries), ``scoring`` (answer matcher), ``stats``
(Wilson, paired bootstrap, McNemar), ``data`` (problem bank), ``ledger``
(append-only, resumable results).
"""

__version__ = "0.1.0"
