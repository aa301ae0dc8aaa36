"""Tables and figures from a profile's ledgers alone (no model).

* :mod:`.summary`: every experiment's summary and endpoint table recomputed from the ledgers;
* :mod:`.paper_tables`: the paper's tables beside ours (numbers and artifact map as data in ``data/paper/``);
* :mod:`.frames`: figure data as tidy frames; :mod:`.figures`: the figures;
* :mod:`.files`: table and figure files;
* :mod:`.results`: a profile's results as data; :mod:`.results_pages`: the README's headline block and the results pages;
* :mod:`.markdown`: how those pages write numbers (rates with Wilson intervals, points, p-values, tables);
* :mod:`.cross_hardware`: one row set computed in several setups, compared token for token;
* :mod:`.cross_family`: two model families on the same problems, one row per endpoint beside the paper's;
* :mod:`.partial`: Experiments 1-5 endpoints of a profile's ledgers, finished or not (unfinished arms included).
"""
