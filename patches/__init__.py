"""kvreuse's boundary with the engines (imported as ``kvreuse.patches``).

Every touch of an engine internal (anything no plugin interface of vLLM or SGLang promises) is a small named
function here, one module per engine and tested version range: ``vllm_0_32`` and ``sglang_0_5``. Each records the
engine symbols it touches in its module's ``MANIFEST`` (with the interface the adapters use directly), and importing
a module refuses an engine version outside the range it was tested with (``versions.check_engine``, one line,
``EngineVersionError``). The adapters in ``kvreuse.vllm`` and ``kvreuse.sglang`` use only the engines' interfaces
and these functions. ``python -m kvreuse.patches`` prints the manifests.
"""
