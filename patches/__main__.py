"""``python -m kvreuse.patches``: every engine symbol kvreuse touches, and the boundary function that touches it.

Prints the manifest of each engine that is installed here (imported with ``KVREUSE_ALLOW_UNTESTED_ENGINE`` set, so
an untested engine version is listed too, with the refusal as a warning).
"""

from __future__ import annotations

import importlib
import importlib.util
import os

from kvreuse.patches.versions import OVERRIDE_VARIABLE

BOUNDARIES = {"vllm": "kvreuse.patches.vllm_0_32", "sglang": "kvreuse.patches.sglang_0_5"}


def main() -> None:
    os.environ.setdefault(OVERRIDE_VARIABLE, "1")
    for engine, module_name in BOUNDARIES.items():
        if importlib.util.find_spec(engine) is None:
            print(f"# {engine}: not installed here")
            continue
        module = importlib.import_module(module_name)
        manifest = module.MANIFEST
        tested = f"tested with {manifest.tested}, accepts {module.TESTED.specifier}"
        print(f"# {engine} {module.VERSION}: {module_name}, {tested}")
        print(f"## internal ({len(manifest.internal)}), touched only by these functions")
        for symbol in manifest.internal:
            print(f"{symbol.used_by:32} {symbol.kind:9} {symbol.path}")
        print(f"## interface ({len(manifest.interface)}), used by the adapters")
        for symbol in manifest.interface:
            print(f"{'':32} {symbol.kind:9} {symbol.path}")


if __name__ == "__main__":
    main()
