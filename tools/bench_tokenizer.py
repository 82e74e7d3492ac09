"""Tokenizer throughput: encode and decode speed of GGUF vocabularies on a text.

    python tools/bench_tokenizer.py ../shared/data/vocab/*.gguf                 # the test strings, repeated
    python tools/bench_tokenizer.py model.gguf --text book.txt --repeat 1

Prints, per vocabulary, the load time, encode MB/s (plain and with special-token parsing), decode MB/s and
the token count. One run each after a warm-up; the text is the .inp test strings of the vocabulary (or
--text), repeated --repeat times so it is long enough to time.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clutor.model.tokenizer import Tokenizer  # noqa: E402


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("vocab", nargs="+", type=Path, help="GGUF files (vocab-only files work)")
    p.add_argument("--text", type=Path, help="UTF-8 text to tokenize (default: the vocabulary's .inp strings)")
    p.add_argument("--repeat", type=int, default=50, help="repeat the text this many times (default 50)")
    args = p.parse_args(argv)

    print(f"{'vocabulary':34s} {'model':5s} {'pre':15s} {'load s':>7s} {'KiB':>7s} {'tokens':>8s} "
          f"{'enc MB/s':>9s} {'enc+sp MB/s':>11s} {'dec MB/s':>9s}")
    for path in args.vocab:
        source = args.text or Path(f"{path}.inp")
        if not source.exists():
            print(f"{path.name}: no text ({source} absent; give --text)", file=sys.stderr)
            continue
        text = source.read_text(encoding="utf-8").replace("\n__ggml_vocab_test__\n", "\n") * args.repeat
        tok, t_load = _timed(lambda: Tokenizer.from_gguf(path))
        tok.encode(text[:10_000])  # warm-up: compiled patterns, category tables
        ids, t_enc = _timed(lambda: tok.encode(text))
        _, t_sp = _timed(lambda: tok.encode(text, special=True))
        _, t_dec = _timed(lambda: tok.decode(ids))
        mb = len(text.encode("utf-8")) / 1e6
        print(f"{path.name:34s} {tok.model:5s} {tok.pre if tok.model == 'gpt2' else '-':15s} {t_load:7.2f} "
              f"{mb * 1e6 / 1024:7.0f} {len(ids):8d} {mb / t_enc:9.2f} {mb / t_sp:11.2f} {mb / t_dec:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
