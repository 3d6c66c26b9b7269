"""The ``sparse`` plugin in vLLM: the attention backend (``backend``), the figures' connector ``KVReuseSparseFigures``
(``connector``) and the figures as Prometheus counters (``metrics``). The backend's figures are read in a worker
with ``kvreuse.vllm.runtime.sparse_figures()``.
"""
