"""The experiments of the paper, one module each (paper §4).

Each module holds an experiment's per-row function (a pure function of one
problem under :class:`kvreplay.runner.RunSpec`), its batched counterpart where
one exists, and the summary and table of its records:

* :mod:`.endpoints`: first divergence and exact ties, shared by all;
* :mod:`.matrix`: the four-arm matrix of Experiments 1 and 2;
* :mod:`.live_vs_prefill`: Experiment 1, live against prefill;
* :mod:`.fixed_prefix`: Experiment 2, fixed prefixes, incremental against prefill, per precision;
* :mod:`.controls`: Experiment 2's FP32 readout and matched null perturbation;
* :mod:`.bridge`: Experiment 3, the incremental bridge and the saved-ledger audit;
* :mod:`.transplant`: Experiment 4, boundary K/V transplants;
* :mod:`.replication`: Experiment 5, the replication on a later checkpoint.

Nothing is imported here: import the module you need.
"""
