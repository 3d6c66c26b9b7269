"""Version-guarded runtime patches for engine internals that have no hook (imported as ``kvreuse.patches``).

Each patch states the engine versions it supports and raises ``kvreuse.errors.EngineVersionError`` on others.
"""
