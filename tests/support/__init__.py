"""What the tests share: the plain-Python oracles (``oracle``: the vLLM / TRT-LLM
replay, ``oracle_sglang``: the SGLang rank), the parity rules every comparison with
the reference applies (``parity_rules``), the reference's per-token artifacts
(``kv_artifacts``) and the pinned Dynamo KV-router runs (``dynamo_runs``).

Importable as ``support`` from every test module: pytest puts ``tests/`` on the
import path (its default ``prepend`` mode, ``tests/`` having no ``__init__.py``);
``benchmarks/differential.py`` and ``benchmarks/dynamo_differential.py`` put it
there themselves."""
