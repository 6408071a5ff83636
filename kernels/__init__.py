"""Numba kernels of aisim_fast (installed as ``aisim_fast.kernels``): ``jit`` (cache folder, lock,
compile notice), ``features`` (optional code compiled only when used), and one room per
concern: ``schema`` (the state and log columns, codes), ``loop`` (the event loop), ``vllm`` /
``trtllm`` / ``sglang`` (the schedulers), ``kv`` (the paged block pool), ``disagg`` (the
prefill -> decode handoff), ``routing`` (placement, the KV router), ``dp`` (attention DP),
``timing``, ``hashing``, ``trace``, ``stats``, ``protocol`` (a rank driven command by command).
"""
