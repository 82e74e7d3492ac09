"""End-to-end benchmark behind ``clutor bench``: Clutor (and optionally llama.cpp) generating the same
greedy tokens from the same prompt, each configuration in its own process.

- ``prompt``       the deterministic benchmark prompt both engines receive
- ``process``      peak memory and disk-read counters of the running process
- ``worker``       one Clutor run: ``python -m clutor.bench.worker MODEL --json-args '{...}'``
- ``llama_worker`` the same run through llama-cpp-python
- ``runner``       starts workers (optionally inside a cgroup memory cap), measures the disk with fio
- ``report``       the tables people read
"""
from __future__ import annotations
