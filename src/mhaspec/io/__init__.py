"""The data layer: bytes and files, nothing of the judging.

- :mod:`.safetensors` — the one safetensors codec (golden fixtures on disk, arrays on the wire).
- :mod:`.atomic` — replacing a folder atomically (the golden folder of ``mhaspec generate``).

Never imports mhaspec.conformance (tests/test_architecture.py).
"""
