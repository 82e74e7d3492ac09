"""Context length as llama.cpp takes it: the file's context_length by default, more only where the
file's YaRN scaling reaches, a prompt over the context refused with both numbers."""
import dataclasses

import pytest

from conftest import fixture_path, run
from clutor.errors import ClutorError
from clutor.model.options import resolve_ctx

MiB = 1 << 20


def _ctx(spec=None, *, n_ctx_train=32768, limit=None, page=MiB, page_tokens=16, state=0, free=64 << 30):
    return resolve_ctx(spec, path="m.gguf", n_ctx_train=n_ctx_train, limit=limit or n_ctx_train, page=page,
                       page_tokens=page_tokens, state=state, free=free)


def test_the_default_is_the_files_context_where_memory_holds_it():
    n, why = _ctx()  # 32768 tokens = 2048 pages of 1 MiB: 2 GiB, under half of 64 GiB
    assert n == 32768 and "context_length" in why


def test_the_default_shortens_to_whole_pages_that_fit_half_the_free_memory():
    n, why = _ctx(free=2 * 1000 * MiB)  # half: 1000 MiB = 1000 pages = 16000 tokens
    assert n == 16000 and "32768" in why and "-c" in why
    n, _ = _ctx(free=2 * 1000 * MiB, state=100 * MiB)  # a fixed state comes off first: 900 pages
    assert n == 900 * 16
    n, _ = _ctx(free=64 * MiB)  # never below 4096 (or the file's, if shorter)
    assert n == 4096
    assert _ctx(free=64 * MiB, n_ctx_train=1024)[0] == 1024


def test_an_explicit_context_past_the_file_is_refused_with_both_numbers():
    with pytest.raises(ClutorError) as e:
        _ctx(40000)
    assert "m.gguf" in str(e.value) and "32768" in str(e.value) and "40000" in str(e.value)
    with pytest.raises(ClutorError):
        _ctx(0)
    assert _ctx(1000, free=0)[0] == 1000  # what is asked is what is used (the KV pool says if it fits)


def test_yarn_reaches_past_the_files_context():
    n, why = _ctx(65536, limit=131072)
    assert n == 65536 and "RoPE scaling" in why
    with pytest.raises(ClutorError) as e:
        _ctx(131073, limit=131072)
    assert "131072" in str(e.value) and "32768" in str(e.value)


def test_an_archs_context_limit_is_its_yarn_reach():
    """gpt-oss's fixture: context_length 512, YaRN x4 from 64 (256, less: the file's 512 stands);
    the same scaling with a 128-token context_length reaches 256."""
    from clutor.model.arch import read_arch
    from clutor.model.gguf import GGUFFile

    f = GGUFFile.open(fixture_path("gptoss", "Q8_0"))
    try:
        arch = read_arch(f)
    finally:
        f.close()
    assert (arch.yarn.factor, arch.yarn.n_ctx_orig, arch.cfg.n_ctx_train) == (4.0, 64, 512)
    assert arch.context_limit() == 512
    arch.cfg = dataclasses.replace(arch.cfg, n_ctx_train=128)
    assert arch.context_limit() == 256
    f = GGUFFile.open(fixture_path("olmoe", "Q8_0"))  # no scaling: its context_length
    try:
        assert read_arch(f).context_limit() == 512
    finally:
        f.close()


def test_open_takes_the_files_context_and_refuses_past_it():
    import clutor

    async def go():
        path = fixture_path("olmoe", "Q8_0")
        async with clutor.Model.open(path, prefix_cache=0) as model:
            assert model.n_ctx == 512 and "context_length" in model.ctx_note
            with pytest.raises(ClutorError) as e:  # the engine's check, before any step
                [o async for o in model.generate(list(range(1, 514)), max_tokens=1)]
            assert "513" in str(e.value) and "512" in str(e.value)
        with pytest.raises(ClutorError) as e:
            async with clutor.Model.open(path, n_ctx=513, prefix_cache=0):
                pass
        assert str(path) in str(e.value) and "512" in str(e.value) and "513" in str(e.value)

    run(go())
