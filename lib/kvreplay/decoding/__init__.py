"""What every decoder shares and the eager decoders: the block contract (``contract``), the tie rule (``ties``), the
run's ``Decoding`` (``settings``), the live, incremental and prefill constructions and the suffix decoder
(``decode``), and storage-isolated replicas and K/V transplants (``caches``)."""
