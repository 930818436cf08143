"""Inferlets that ship with pie: `openai_completions.py` serves the server's OpenAI-compatible API.

These are guest programs (built into components with `pie build`), not host modules: nothing here
is imported by the host; `BUILTIN_DIR` tells the server where the sources are.
"""
from pathlib import Path

BUILTIN_DIR = Path(__file__).resolve().parent

__all__ = ["BUILTIN_DIR"]
