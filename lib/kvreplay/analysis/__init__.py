"""Measures computed from rows and tensors: Wilson, McNemar and the paired bootstrap (``stats``), answer scoring
(``scoring``) and per-tensor drift (``drift``)."""
