"""Loading a model under the execution contract: the contract itself (``execution``), the invariant kernels
(``kernels_contract``, ``kernels``, ``kernels_fused``), a model's attention layout (``layout``), the checks before
and after its weights load (``model_checks``, ``self_check``) and the loader (``models``)."""
