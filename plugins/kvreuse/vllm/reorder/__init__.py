"""The ``reorder`` plugin in vLLM: the prefix-affinity scheduler (``scheduler``, named with ``--scheduler-cls
kvreuse.vllm.PrefixAffinityScheduler``) and its counters as Prometheus metrics (``metrics``)."""
