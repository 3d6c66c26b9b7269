"""kvreuse: out-of-tree plugins for vLLM and SGLang that reuse KV cache engines waste on structured-data jobs.

Subpackages: ``reorder`` (request reordering), ``modules`` (position-independent module cache), ``sparse``
(DIPR sparse decode attention) are engine-free cores; ``vllm`` and ``sglang`` are the engine adapters;
``kvreuse.kernels`` (the repository's ``triton_kernels/``) holds the Triton kernels and ``kvreuse.patches``
(``patches/``) the version-guarded engine patches.
"""

__version__ = "0.1.0"
