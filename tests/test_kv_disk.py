"""The prefix cache on disk (clutor.model.kv_disk): pages written as they are published, loaded after a
restart, checked before use, bounded in bytes; and every failure a recompute, never a failed request.

Each reuse is checked against the same prompt computed from scratch: the loaded pages' bytes equal the
pages the first process computed, and the greedy tokens equal a run without the cache.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil

import numpy as np
import pytest

import clutor
from clutor.model import kv_disk, kv_pages
from clutor.model.gguf import GGUFFile
from clutor.model.kv import PAGE, ROOT, _key

from conftest import fixture_path, run

PROMPT = list(range(5, 5 + 7 * PAGE + 3))  # 7 full pages, 3 positions more


async def _generate(model, prompt, n=6):
    toks, stats = [], None
    async for o in model.generate(prompt, max_tokens=n, temperature=0, ignore_eos=True):
        if o.token is not None:
            toks.append(o.token)
        stats = o.stats or stats
    return toks, stats


def _pages(model) -> dict[tuple[int, bytes], bytes]:
    """Every full page the pool publishes, by (group, chain key): its values' and scales' bytes."""
    out = {}
    for gi, g in enumerate(model.kv.groups):
        for p in range(g.high):
            if g.filled[p] == PAGE and g.entries[p] and g.by_prefix.get(g.entries[p][-1]) == p:
                out[(gi, g.entries[p][-1])] = g.data[p].tobytes() + (g.scales[p].tobytes() if g.scales is not None else b"")
    return out


def _chain(tokens, n: int) -> list[bytes]:
    """The chain keys of tokens' first n pages, as the pool names them."""
    keys, k = [], ROOT
    for i in range(n):
        k = _key(k, np.asarray(tokens[i * PAGE : (i + 1) * PAGE], dtype="<i4"))
        keys.append(k)
    return keys


def _session(path, d, prompt=PROMPT, **opts):
    """One process's worth: open, generate, close. (tokens, stats, published pages, disk stats)."""
    async def go():
        async with clutor.Model.open(path, prefix_cache_disk=d, **opts) as model:
            toks, stats = await _generate(model, prompt)
            pages = _pages(model)
            await model.kv.disk.aclose()  # everything queued is written before the numbers are read
            return toks, stats, pages, model.kv.disk.stats()
    return run(go())


@pytest.mark.parametrize("arch,kv_type", [("olmoe", "f32"), ("qwen3moe", "q8_0"), ("gptoss", "f16")])
def test_a_restart_loads_the_prompts_pages_bit_for_bit(tmp_path, arch, kv_type):
    """gptoss has sliding-window layers (a page group of their own), q8_0 stores scales beside values."""
    path = fixture_path(arch, "Q8_0")
    opts = dict(io="threads", expert_cache="50%", kv_type=kv_type)
    toks1, s1, pages1, d1 = _session(path, tmp_path, **opts)
    assert s1.cached_tokens == 0 and d1.written >= 7 and d1.files == d1.written
    toks2, s2, pages2, d2 = _session(path, tmp_path, **opts)
    assert s2.cached_tokens == 7 * PAGE  # the prompt's full pages; the rest is computed
    assert d2.loaded >= 7 and d2.rejected == 0
    shared = set(pages1) & set(pages2)
    assert len(shared) >= 7
    assert all(pages1[k] == pages2[k] for k in shared)
    assert toks2 == toks1


def test_pages_that_do_not_check_are_computed_with_a_log_line(tmp_path, caplog):
    path = fixture_path("olmoe", "Q8_0")
    opts = dict(io="threads", expert_cache="50%", kv_type="f32")
    toks1, _, _, d1 = _session(path, tmp_path, **opts)
    files = sorted(os.listdir(d1.root))
    assert len(files) == d1.files >= 7
    # the page after the 3rd, by chain: find the files of the prompt's pages in chain order
    keys = _chain(PROMPT, 7)
    names = [f"g0-{k.hex()}.kvp" for k in keys]
    assert set(names) <= set(files)
    victim = os.path.join(d1.root, names[3])
    with open(victim, "r+b") as f:  # one payload byte flipped: the checksum no longer matches
        f.seek(kv_pages.HEADER + 100)
        b = f.read(1)
        f.seek(kv_pages.HEADER + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    with caplog.at_level(logging.WARNING, logger="clutor.kv"):
        toks2, s2, _, d2 = _session(path, tmp_path, **opts)
    assert s2.cached_tokens == 3 * PAGE  # pages 0-2 loaded, 3 rejected: the chain stops there
    assert d2.rejected == 1 and toks2 == toks1
    assert any("checksum" in r.getMessage() and names[3] in r.getMessage() for r in caplog.records)
    # the rejected file was removed, and the recomputed page written again
    assert os.path.exists(victim)
    with open(victim, "r+b") as f:  # cut short
        f.truncate(kv_pages.HEADER + 10)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="clutor.kv"):
        toks3, s3, _, d3 = _session(path, tmp_path, **opts)
    assert s3.cached_tokens == 3 * PAGE and d3.rejected == 1 and toks3 == toks1
    assert any("truncated" in r.getMessage() for r in caplog.records)


def test_a_page_of_another_model_or_kv_type_is_never_used(tmp_path, caplog):
    path = fixture_path("olmoe", "Q8_0")
    opts = dict(io="threads", expert_cache="50%")
    _, _, _, d1 = _session(path, tmp_path, kv_type="f32", **opts)
    _, s2, _, d2 = _session(path, tmp_path, kv_type="f16", **opts)
    assert d2.root != d1.root and s2.cached_tokens == 0 and d2.loaded == 0
    # a file of this model's directory whose header names another model: ignored, computed
    keys = _chain(PROMPT, 1)
    victim = os.path.join(d1.root, f"g0-{keys[0].hex()}.kvp")
    with open(victim, "r+b") as f:
        raw = f.read(kv_pages.HEADER)
        at = raw.index(b'"model": "') + len(b'"model": "')
        f.seek(at)
        f.write(b"0" * 8)
    with caplog.at_level(logging.WARNING, logger="clutor.kv"):
        _, s3, _, d3 = _session(path, tmp_path, kv_type="f32", **opts)
    assert s3.cached_tokens == 0 and d3.rejected == 1
    assert any("'model'" in r.getMessage() for r in caplog.records)


def test_the_model_files_identity_follows_its_weights(tmp_path):
    src = fixture_path("olmoe", "Q8_0")
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(src, copy)
    with GGUFFile.open(src) as f:
        a = kv_pages.file_identity(f)
        t = f.tensors["token_embd.weight"]
    with GGUFFile.open(copy) as f:
        assert kv_pages.file_identity(f) == a
    with open(copy, "r+b") as f:  # other weights in one tensor (as another seed or a fine-tune gives)
        f.seek(t.offset)
        f.write(np.random.default_rng(0).integers(0, 255, t.nbytes, dtype=np.uint8).tobytes())
    with GGUFFile.open(copy) as f:
        assert kv_pages.file_identity(f) != a


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS])
def test_a_full_or_read_only_disk_costs_only_the_reuse(tmp_path, monkeypatch, caplog, err):
    """As root, a mode-0555 directory is still writable: the failure is injected where the file opens."""
    path = fixture_path("olmoe", "Q8_0")
    opts = dict(io="threads", expert_cache="50%", kv_type="f32")

    def refuse(p, direct):
        raise OSError(err, os.strerror(err), p)

    monkeypatch.setattr(kv_disk, "open_for_write", refuse)
    with caplog.at_level(logging.WARNING, logger="clutor.kv"):
        toks, s, _, d = _session(path, tmp_path, **opts)
    assert len(toks) == 6 and d.written == 0 and d.files == 0 and d.dropped >= 1
    assert sum("prefix cache on disk" in r.getMessage() for r in caplog.records) == 1  # once, not per page
    assert not [f for f in os.listdir(d.root) if f.endswith(".tmp")]
    monkeypatch.undo()
    toks2, s2, _, _ = _session(path, tmp_path, **opts)
    assert toks2 == toks and s2.cached_tokens == 0


def test_the_store_keeps_to_its_size_least_recently_used_out(tmp_path):
    path = fixture_path("olmoe", "Q8_0")
    opts = dict(io="threads", expert_cache="50%", kv_type="f32")
    _, _, _, d = _session(path, tmp_path, **opts)
    record = d.bytes // d.files
    size = 9 * record
    a = list(range(200, 200 + 5 * PAGE + 1))
    b = list(range(400, 400 + 5 * PAGE + 1))
    _session(path, tmp_path, prompt=a, prefix_cache_disk_size=size, **opts)
    _, _, _, d2 = _session(path, tmp_path, prompt=b, prefix_cache_disk_size=size, **opts)
    assert d2.bytes <= size and d2.files == 9
    keys_b = _chain(b, 5)
    names = set(os.listdir(d2.root))
    assert all(f"g0-{k.hex()}.kvp" in names for k in keys_b)  # the newest prompt's pages all kept
    _, s, _, _ = _session(path, tmp_path, prompt=b, prefix_cache_disk_size=size, **opts)
    assert s.cached_tokens == 5 * PAGE


def test_a_recurrent_model_opens_without_the_disk_cache(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="clutor.kv"):
        async def go():
            async with clutor.Model.open(fixture_path("qwen35moe", "Q4_K_M"), io="memory",
                                         prefix_cache_disk=tmp_path) as model:
                toks, _ = await _generate(model, PROMPT, 2)
                return model.kv.disk, toks
        disk, toks = run(go())
    assert disk is None and len(toks) == 2
    assert any("recurrent" in r.getMessage() for r in caplog.records)


def test_a_bad_size_is_refused_naming_the_option():
    with pytest.raises(clutor.ClutorError, match="prefix_cache_disk_size"):
        clutor.Model.open(fixture_path("olmoe", "Q8_0"), prefix_cache_disk="/tmp/x", prefix_cache_disk_size="lots")


def test_a_saved_slot_restores_the_prefix_whose_pages_check(tmp_path):
    """Model.save_slot / restore_slot (llama-server's /slots files): a restore in a new process holds the
    pages for the next prompt; a record that does not check ends the restored prefix there."""
    path = fixture_path("olmoe", "Q8_0")
    opts = dict(io="threads", expert_cache="50%", kv_type="f32")
    slot = tmp_path / "slot.bin"

    async def first():
        async with clutor.Model.open(path, **opts) as model:
            toks, _ = await _generate(model, PROMPT)
            saved = await model.save_slot(PROMPT + toks[:-1], slot)
            return toks, saved, _pages(model)

    async def second(**kw):
        async with clutor.Model.open(path, prefix_cache=0, **opts) as model:
            restored = await model.restore_slot(slot)
            toks, stats = await _generate(model, PROMPT)
            pages = _pages(model)
            model.release_slot(restored)
            return restored, toks, stats, pages, model.engine_stats()

    toks1, saved, pages1 = run(first())
    assert saved.n_tokens == (len(PROMPT) + 5) // PAGE * PAGE and saved.n_bytes == os.path.getsize(slot)
    restored, toks2, stats, pages2, es = run(second())
    assert len(restored.tokens) == saved.n_tokens == stats.cached_tokens  # (page 7 was never full)
    assert toks2 == toks1 and all(pages1[k] == pages2[k] for k in set(pages1) & set(pages2))
    assert es.kv_bytes == 0  # released
    record = restored.n_bytes // (saved.n_tokens // PAGE)
    head = os.path.getsize(slot) - restored.n_bytes
    with open(slot, "r+b") as f:  # one payload byte of the 4th page's record flipped
        at = head + 3 * record + kv_pages.HEADER + 7
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 1]))
    restored, toks3, stats, _, _ = run(second())
    assert len(restored.tokens) == 3 * PAGE and stats.cached_tokens == 3 * PAGE and toks3 == toks1
    with open(slot, "r+b") as f:
        f.write(b"JUNK")
    with pytest.raises(clutor.ClutorError, match="not a Clutor slot file"):
        run(second())


def test_every_page_is_written_even_when_its_sequence_ends_first(tmp_path, monkeypatch):
    """A slow disk: the request ends (and, with no prefix cache in RAM, gives its pages back) long
    before the writer reaches them, and the next request is handed the same pages; the writer still
    writes the first one's keys and values, which a restart loads bit for bit."""
    import time as _time

    real = kv_disk.open_for_write

    def slow(path, direct):
        _time.sleep(0.05)
        return real(path, direct)

    path = fixture_path("olmoe", "Q8_0")
    opts = dict(io="threads", expert_cache="50%", kv_type="f32")
    other = list(range(300, 300 + len(PROMPT)))

    async def first():
        async with clutor.Model.open(path, prefix_cache_disk=tmp_path, prefix_cache=0, **opts) as model:
            await _generate(model, PROMPT)
            await _generate(model, other)  # takes the pages PROMPT's sequence gave back
            await model.kv.disk.aclose()
            return model.kv.disk.stats()

    monkeypatch.setattr(kv_disk, "open_for_write", slow)
    d = run(first())
    assert d.written == d.files == 2 * ((len(PROMPT) + 5) // PAGE) and d.dropped == 0
    monkeypatch.undo()
    toks, s, loaded, _ = _session(path, tmp_path, **opts)
    assert s.cached_tokens == 7 * PAGE

    async def fresh():
        async with clutor.Model.open(path, **opts) as model:
            toks, _ = await _generate(model, PROMPT)
            return toks, _pages(model)

    toks_fresh, computed = run(fresh())
    shared = set(loaded) & set(computed)
    assert len(shared) >= 7 and all(loaded[k] == computed[k] for k in shared) and toks == toks_fresh
