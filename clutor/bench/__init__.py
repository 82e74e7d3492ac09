"""What the benchmark commands run: ``clutor bench`` (Clutor, and optionally llama.cpp, generating the
same greedy tokens from the same prompt, each configuration in its own process), ``clutor bench-io``
and ``clutor bench-serve``.

- ``prompt``       the deterministic benchmark prompt both engines receive
- ``process``      peak memory and disk-read counters of the running process
- ``worker``       one Clutor run: ``python -m clutor.bench.worker MODEL --json-args '{...}'``
- ``llama_worker`` the same run through llama-cpp-python
- ``runner``       starts workers (optionally inside a cgroup memory cap), measures the disk with fio
- ``report``       the tables people read
- ``memcap``       a command under a cgroup memory cap (``--cap``), also for the tests' memory bounds
- ``disk``         ``clutor bench-io``: random aligned reads through each backend, next to fio
- ``serve_load``   ``clutor bench-serve``: N concurrent streaming clients against an OpenAI-compatible server
"""
from __future__ import annotations
