"""The programs wing of the sandbox: from an inferlet's source to a compiled component.

- cache.py           ProgramCache: check a component against the world, compile, cache on disk
- build.py           `pie build`: a Python inferlet -> a component (componentize-py)
- compile_worker.py  compiling in a bounded child process
- component_names.py a component's import / export names, read before compiling
- memory_image.py    a program's heap image, taken out of its data segments

May import: wasmtime, inferlets.sdk (build.py), leaves.
"""
from host.sandbox.programs.cache import (Program, ProgramCache, ProgramError, ProgramStats,
                                         make_engine)

__all__ = ["Program", "ProgramCache", "ProgramError", "ProgramStats", "make_engine"]
