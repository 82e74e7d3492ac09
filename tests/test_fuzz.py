"""Mutated GGUF files (seeded, reproducible) give a ClutorError or work: never another exception, never
a hang, never runaway memory. A few hundred mutants run in CI; the full 10,000 with `-m fuzz_full`.

A failure names the fixture, seed and mutant index; reproduce it with
    python tests/fuzz_util.py FIXTURE --seed SEED --first INDEX --count 1 --dir /tmp
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import fixture_path

REPO = Path(__file__).resolve().parents[1]
HANG_SECONDS = 10        # no single mutant may take longer
MAX_RSS = 1 << 30        # the worker's peak resident memory (runtime + numba ~250 MiB here)
SEED = int(os.environ.get("CLUTOR_FUZZ_SEED", "0"))


def _fuzz(fixture: Path, count: int, tmp_path: Path) -> dict[str, int]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONWARNINGS"] = "ignore"  # mutated weights overflow in numpy: fine, not what we look for
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "fuzz_util.py"), str(fixture), "--seed", str(SEED),
                             "--count", str(count), "--dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO, text=True)
    outcomes: dict[str, int] = {}
    crashes: list[str] = []
    peak, last, buf = 0, -1, ""
    # the first mutant also pays for imports and loading the compiled kernels
    deadline = time.monotonic() + 120
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"{fixture.name} seed {SEED}: mutant {last + 1} ran over {HANG_SECONDS} s (a hang)")
            r, _, _ = select.select([proc.stdout], [], [], left)
            if not r:
                continue
            line = proc.stdout.readline()
            if not line:
                break
            rec = json.loads(line)
            last = rec["i"]
            deadline = time.monotonic() + HANG_SECONDS
            outcomes[rec["outcome"]] = outcomes.get(rec["outcome"], 0) + 1
            peak = max(peak, rec["vm_hwm"])
            if rec["outcome"] == "CRASH":
                crashes.append(f"mutant {rec['i']}:\n{rec['detail']}")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    err = proc.stderr.read()
    assert proc.returncode == 0, f"worker died ({proc.returncode}) after mutant {last}: {err[-3000:]}"
    assert last == count - 1, f"worker stopped after mutant {last} of {count}"
    assert not crashes, f"{fixture.name} seed {SEED}: {len(crashes)} non-Clutor exceptions\n" + "\n".join(crashes[:3])
    assert peak <= MAX_RSS, f"{fixture.name} seed {SEED}: peak RSS {peak >> 20} MiB"
    return outcomes


@pytest.mark.parametrize("arch", ["olmoe", "qwen2moe", "qwen3moe"])
def test_fuzz_mutated_models(tmp_path, arch):
    outcomes = _fuzz(fixture_path(arch, "Q4_K_M"), 100, tmp_path)
    # the mutants reach past the parser too: some open and run
    assert outcomes.get("parsed", 0) + outcomes.get("ran", 0) > 0, outcomes


@pytest.mark.fuzz_full
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("arch, qtype", [("olmoe", "Q8_0"), ("qwen2moe", "Q4_K_M"), ("qwen3moe", "F16")])
def test_fuzz_full(tmp_path, arch, qtype, request):
    if "fuzz_full" not in (request.config.getoption("-m") or ""):
        pytest.skip("the full fuzz run (10,000 mutants) is opt-in: python -m pytest -m fuzz_full tests/test_fuzz.py")
    _fuzz(fixture_path(arch, qtype), 3334, tmp_path)
