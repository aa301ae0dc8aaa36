"""The problems: the record and the frozen MMLU bank as the experiments load it (``problems``), the bank's source
(``bank_source``) and its build and verification (``bank``, ``python -m kvreplay.data.bank``)."""
