"""The command line a new user meets: every failure is one `clutor: error:` line and exit code 1 (no
traceback), habit flags from llama.cpp work, and the chat behaves at a real terminal (a pty)."""
from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clutor.io.policies import DEFAULT_POLICY
from clutor.cli import main
from conftest import fixture_path

REPO = Path(__file__).resolve().parents[1]
MODEL = str(fixture_path("qwen3moe", "Q8_0"))
FAST = ["-n", "3", "--temperature", "0", "--ignore-eos"]


def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def _clutor(*args, **kw) -> list:
    return [sys.executable, "-c", "import sys; from clutor.cli import main; sys.exit(main())", *args]


def _one_error_line(err: str) -> None:
    assert err.startswith("clutor: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err


# -- one line, exit 1 -----------------------------------------------------------------------------
@pytest.mark.parametrize("what", ["missing", "directory", "gguf", "fifo"])
def test_simulate_on_a_wrong_path(tmp_path, capsys, what):
    path = {"missing": tmp_path / "nope.jsonl", "directory": tmp_path, "gguf": Path(MODEL),
            "fifo": tmp_path / "fifo"}[what]
    if what == "fifo":
        os.mkfifo(path)
    assert main(["simulate", str(path)]) == 1
    _one_error_line(capsys.readouterr().err)


def test_ctrl_c_during_start_up_imports(monkeypatch, capsys):
    import clutor.cli as cli

    def interrupted(name, package=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.importlib, "import_module", interrupted)
    assert main(["info", MODEL]) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_importing_the_cli_does_not_import_the_engine():
    # What runs before main()'s handlers: a Ctrl-C there would be a traceback. Keep it small.
    p = subprocess.run([sys.executable, "-c", "import sys, clutor.cli; print('numpy' in sys.modules)"],
                       capture_output=True, text=True, env=_env(), cwd=REPO, timeout=60)
    assert p.stdout.strip() == "False", p.stderr


def test_stdout_on_a_full_disk():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    with open("/dev/full", "w") as full:
        p = subprocess.run(_clutor("generate", MODEL, "hello", *FAST), stdout=full, stderr=subprocess.PIPE,
                           text=True, env=_env(), cwd=REPO, timeout=300)
    assert p.returncode == 1
    # on a fresh checkout the kernels compile first, and the command says so before and after
    compile_notes = ("clutor: compiling the compute kernels", "clutor: compute kernels ready")
    err = "".join(line for line in p.stderr.splitlines(keepends=True) if not line.startswith(compile_notes))
    _one_error_line(err)
    assert "cannot write the output" in err


def test_stdout_closed_early_ends_quietly():
    p = subprocess.Popen(_clutor("generate", MODEL, "hello", "-n", "40", "--temperature", "0", "--ignore-eos"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=REPO)
    p.stdout.read(1)  # `| head -c 1`
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 0
    assert "Traceback" not in err and "Exception ignored" not in err and "Broken pipe" not in err


@pytest.mark.parametrize("args, message", [
    (["demo", "-n", "0"], "max-tokens"),
    (["generate", MODEL, "hi", "-n", "0"], "max-tokens"),
    (["generate", MODEL, "hi", "-n", "-5"], "max-tokens"),
    (["generate", MODEL, "hi", "--top-p", "0"], "top_p"),
    (["generate", MODEL, "hi", "-t", "0"], "threads"),
    (["generate", MODEL, "hi", "-p", "also"], "give the prompt once"),
    (["generate", MODEL], "give the prompt once"),
    (["generate", MODEL, "-f", "/nonexistent/prompt.txt"], "prompt file"),
    (["generate", MODEL, "hi", "--chat-template", "/nonexistent/t.jinja"], "chat template"),
    (["bench-io", "--size", "1KiB"], "smaller than block"),
])
def test_bad_options_fail_before_doing_work(capsys, args, message):
    assert main(args) == 1
    err = capsys.readouterr().err
    _one_error_line(err)
    assert message in err


# -- invalid UTF-8: U+FFFD, as llama.cpp's tools do -----------------------------------------------
def test_invalid_utf8_in_argv_and_stdin_is_replaced_not_a_traceback():
    bad = b"caf\xe9 \xff\xfe ok"
    p = subprocess.run([os.fsencode(a) for a in _clutor("generate", MODEL, "x", *FAST)][:-len(FAST) - 1]
                       + [bad] + [a.encode() for a in FAST], capture_output=True, env=_env(), cwd=REPO, timeout=300)
    assert p.returncode == 0 and b"Traceback" not in p.stderr, p.stderr
    p = subprocess.run(_clutor("generate", MODEL, "-", *FAST), input=bad, capture_output=True, env=_env(),
                       cwd=REPO, timeout=300)
    assert p.returncode == 0 and b"Traceback" not in p.stderr, p.stderr
    p = subprocess.run(_clutor("chat", MODEL, *FAST), input=bad + b"\n/exit\n", capture_output=True,
                       env=_env(HOME=str(REPO / "nonexistent-home")), cwd=REPO, timeout=300)
    assert p.returncode == 0 and b"Traceback" not in p.stderr and b"3 generated" in p.stderr, p.stderr


def test_tokenizer_encodes_lone_surrogates_as_replacement_characters():
    from clutor import Tokenizer

    tok = Tokenizer.from_gguf(MODEL)
    # "\udce9" is how Python carries the undecodable byte 0xE9 from argv (surrogateescape)
    assert tok.encode("caf\udce9 \ud800!") == tok.encode("caf\ufffd \ufffd!")


# -- habit flags ----------------------------------------------------------------------------------
def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == "clutor 0.1.0"


def test_llama_cpp_style_flags(tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Once upon a time")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] ")
    assert main(["generate", MODEL, "-f", str(prompt), "-c", "64", "-t", "1", "-s", "7", "-n", "-1",
                 "--temp", "0.5", "--ignore-eos"]) == 0
    err = capsys.readouterr().err
    # -n -1: until the 64-token context is full, which ends with stop reason "length"
    n_prompt = int(err.split("[")[1].split(" prompt tokens")[0])
    assert f"{64 - n_prompt + 1} generated" in err and "stop: length" in err
    assert main(["generate", MODEL, "-p", "Hi", "--chat-template", str(template), *FAST]) == 0
    assert main(["generate", MODEL, "-p", "Hi", "--chat-template", str(tmp_path / "bad.jinja"), *FAST]) == 1
    assert "bad.jinja" in capsys.readouterr().err


def _parse(*argv):
    from clutor.cli import build_parser

    return build_parser().parse_args(list(argv))


def test_each_llama_cpp_flag_means_what_it_means_there(capsys):
    a = _parse("generate", "-m", MODEL, "-p", "hi", "--n-predict", "7", "-sys", "S", "--repeat-last-n", "8",
               "--presence-penalty", "0.5", "--frequency-penalty", "0.25", "-np", "3", "-c", "128", "-t", "2",
               "-s", "5", "-b", "64", "--temp", "0.3")
    assert (a.model_file, a.prompt_opt, a.max_tokens, a.system, a.repeat_last_n, a.presence_penalty,
            a.frequency_penalty, a.max_sequences, a.n_ctx, a.threads, a.seed, a.step_tokens, a.temperature) == (
        MODEL, "hi", 7, "S", 8, 0.5, 0.25, 3, 128, 2, 5, 64, 0.3)
    assert _parse("generate", MODEL, "hi", "--predict", "4").max_tokens == 4
    a = _parse("chat", "-m", MODEL, "--system-prompt", "Be brief.", "--parallel", "2")
    assert a.system == "Be brief." and a.max_sequences == 2
    a = _parse("serve", "-m", MODEL, "--alias", "qwen", "-np", "4", "-c", "256", "--port", "0")
    assert (a.served_model_name, a.max_sequences, a.n_ctx) == ("qwen", 4, 256)
    assert _parse("info", "-hf", "Qwen/Qwen3-30B-A3B-GGUF:Q4_K_M").hf_repo == "Qwen/Qwen3-30B-A3B-GGUF:Q4_K_M"
    capsys.readouterr()
    # what has no meaning here is accepted, with one line saying why
    a = _parse("generate", MODEL, "hi", "-ngl", "99", "--mlock", "-fa", "on", "--no-mmap", "--jinja")
    err = capsys.readouterr().err
    for flag in ("-ngl", "--mlock", "-fa", "--no-mmap", "--jinja"):
        assert f"clutor: note: {flag} ignored: " in err, flag
    assert a.prompt == "hi" and a.max_tokens == 128  # -ngl did not become -n gl
    from clutor.cli.common import model_kwargs

    for flags, kv in ((("-ctk", "q8_0", "-ctv", "q8_0"), "q8_0"), (("--cache-type-v", "f32"), "f32"), ((), "f16")):
        assert model_kwargs(_parse("generate", MODEL, "hi", *flags))["kv_type"] == kv, flags
    _parse("serve", MODEL, "-cb", "--metrics", "--n-gpu-layers", "99")
    assert "-cb ignored: always on" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["generate", MODEL, "hi", "-ngx", "3"], "unknown option -ngx"),
    (["generate", MODEL, "hi", "-n32"], "for -n 32, write it so"),     # never glued: -n32 is not -n 32
    (["generate", MODEL, "hi", "-ctx", "3"], "unknown option -ctx (`clutor generate --help`"),  # not "-c tx"
    (["generate", MODEL, "hi", "-ctk", "f16", "-ctv", "q8_0"], "-ctk f16 with -ctv q8_0: keys and values"),
    (["generate", MODEL, "hi", "--kv-type", "f32", "-ctk", "q8_0"], "--kv-type f32 with -ctk/-ctv q8_0"),
    (["generate", MODEL, "hi", "-ctk", "q4_9"], "argument -ctk/--cache-type-k: invalid choice"),
    (["chat", MODEL, "-sysx", "a"], "unknown option -sysx"),
    (["generate", MODEL, "hi", "--max-tok", "3"], "unrecognized arguments: --max-tok"),  # no abbreviations
    (["generate", MODEL, "hi", "-n", "gl"], "invalid int value: 'gl'"),
    (["serve", MODEL, "--port"], "expected one argument"),
    (["nonsense"], "invalid choice: 'nonsense'"),
    (["generate", "-m", MODEL, "-hf", "a/b", "hi"], "give the model once"),
    (["info"], "no model given"),
])
def test_a_parse_error_is_one_line_and_exit_1(argv, says, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    _one_error_line(err)
    assert says in err and "--help" in err or says in err, err


def test_the_first_run_compile_is_said_before_and_after(monkeypatch, capsys, caplog):
    """Everywhere: a logging record for API users (and `clutor serve`'s log), a line from the CLI, on a
    terminal or not. (The compile itself is faked: compiled() says the cache is empty.)"""
    import logging

    from clutor.model import kernels

    monkeypatch.setattr(kernels, "compiled", lambda **_: False)
    monkeypatch.setattr(kernels, "_warm", False)  # as in a process that has not warmed them yet
    with caplog.at_level(logging.INFO, logger="clutor.kernels"):
        kernels.warmup()
    said = [r.getMessage() for r in caplog.records if r.name == "clutor.kernels"]
    assert len(said) == 2 and said[0].startswith("compiling the compute kernels") and "ready in" in said[1]
    assert "clutor warmup" in said[0] and str(kernels.cache_dir()) in said[0]
    caplog.clear()
    kernels.warmup()
    assert not caplog.records  # a second warm-up in the same process has nothing to say
    monkeypatch.setattr(kernels, "_warm", False)
    assert main(["generate", MODEL, "hi", *FAST]) == 0  # stderr is not a terminal here
    err = capsys.readouterr().err
    assert err.index("clutor: compiling the compute kernels") < err.index("clutor: compute kernels ready in") < err.index("generated")
    monkeypatch.setattr(kernels, "compiled", lambda **_: True)
    assert main(["warmup"]) == 0
    assert "already compiled" in capsys.readouterr().err


def test_generate_api_prompt_fits_but_not_max_tokens():
    import clutor
    from conftest import run

    async def go():
        async with clutor.Model.open(MODEL, n_ctx=16, io="memory") as m:
            ids = list(range(10, 20))  # 10 of the 16 positions
            chunks = [c async for c in m.generate(ids, max_tokens=100, temperature=0, ignore_eos=True)]
            stats = chunks[-1].stats
            assert stats.generated_tokens == 7 and stats.stop_reason == "length"
            with pytest.raises(clutor.ClutorError, match="more than the context"):
                [c async for c in m.generate(list(range(10, 27)), max_tokens=1)]

    run(go())


def test_help_shows_each_default_once_and_right(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--buffered reads through the page cache --trace" in out  # no "(default: True)" on a flag
    for flag in ("--top-k", "--top-p", "--min-p", "--repeat-penalty", "--temperature", "--seed"):
        text = out.split(flag, 2)[-1][:200]
        assert "default" in text, flag
    assert out.count(f"(default: {DEFAULT_POLICY})") == 1 and "default: None" not in out


def test_report_without_prefetch_does_not_show_prefetch_accuracy(capsys):
    # one stream prefetches by default (--prefetch auto): this report is asked for without it
    assert main(["generate", MODEL, "hi", *FAST, "--expert-cache", "50%", "--prefetch", "off"]) == 0
    err = capsys.readouterr().err
    assert "hit rate" in err and "prefetched" not in err
    assert main(["generate", MODEL, "hi", *FAST, "--io", "memory", "--expert-cache", "1GiB"]) == 0
    assert "do not apply with --io memory" in capsys.readouterr().err


# -- chat commands --------------------------------------------------------------------------------
def test_chat_commands(tmp_path, capsys, monkeypatch):
    import io

    monkeypatch.setenv("HOME", str(tmp_path))
    saved = tmp_path / "convo.json"
    script = (f"Hello\n/save {saved}\n/x\n/clear\n/save {tmp_path / 'empty.json'}\n/load {saved}\n"
              f"/load {tmp_path / 'missing.json'}\n/help\n//slash\n/exit\nnot read\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO(script))
    assert main(["chat", MODEL, *FAST, "--system", "Be brief."]) == 0
    err = capsys.readouterr().err
    convo = json.loads(saved.read_text())
    assert [m["role"] for m in convo] == ["system", "user", "assistant"] and convo[1]["content"] == "Hello"
    assert json.loads((tmp_path / "empty.json").read_text()) == [{"role": "system", "content": "Be brief."}]
    assert "unknown command /x" in err and "loaded 3 messages" in err and "missing.json" in err
    assert "/save FILE" in err  # the help
    assert err.count("3 generated") == 2  # "Hello" and "/slash" were sent; nothing else was


# -- a real terminal ------------------------------------------------------------------------------
class _Pty:
    def __init__(self, args, env):
        import fcntl
        import pty
        import termios

        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=REPO,
                                     start_new_session=True,
                                     preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        os.close(slave)
        self.out = b""

    def expect(self, text: bytes, timeout: float = 240) -> bytes:
        deadline = time.monotonic() + timeout
        while text not in self.out:
            left = deadline - time.monotonic()
            assert left > 0, f"waited for {text!r}; got {self.out[-2000:]!r}"
            r, _, _ = select.select([self.master], [], [], left)
            if r:
                try:
                    chunk = os.read(self.master, 4096)
                except OSError:
                    chunk = b""
                assert chunk, f"terminal closed while waiting for {text!r}; got {self.out[-2000:]!r}"
                self.out += chunk
        i = self.out.index(text) + len(text)
        seen, self.out = self.out[:i], self.out[i:]
        return seen

    def more(self, timeout: float = 240) -> None:
        """Wait until the program writes something more."""
        while not self.out:
            r, _, _ = select.select([self.master], [], [], timeout)
            assert r, "nothing more was written"
            self.out += os.read(self.master, 4096)

    def send(self, data: bytes) -> None:
        os.write(self.master, data)

    def ctrl_c(self) -> None:
        """Type Ctrl-C until the program answers "^C". (A SIGINT that lands after readline drew the
        prompt but before it blocks in select() waits for the next key: CPython's readline race, not
        ours. A user presses again; so does this.)"""
        for _ in range(10):
            self.send(b"\x03")
            try:
                self.expect(b"^C", timeout=3)
                return
            except AssertionError:
                continue
        raise AssertionError(f"Ctrl-C never answered; got {self.out[-2000:]!r}")

    def rest(self) -> bytes:
        """Whatever the program wrote after the last expect(), once it has exited."""
        while True:
            try:
                chunk = os.read(self.master, 4096)
            except OSError:
                break
            if not chunk:
                break
            self.out += chunk
        return self.out

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=60)
        finally:
            os.close(self.master)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_ctrl_c_at_the_idle_chat_prompt_is_not_remembered(tmp_path, loop):
    (tmp_path / ".clutor").write_text("a file where the history directory should be")
    block = "" if loop == "uvloop" else "sys.modules['uvloop'] = None; "  # run_coro falls back to asyncio
    args = [sys.executable, "-c", f"import sys; {block}from clutor.cli import main; sys.exit(main())",
            "chat", MODEL, "-n", "4", "--temperature", "0", "--ignore-eos"]
    t = _Pty(args, _env(HOME=str(tmp_path)))
    t.expect(b"chat history not kept")  # ~/.clutor is a file: said once, the chat goes on
    t.expect(b"> ")
    t.ctrl_c()                          # Ctrl-C at the idle prompt: clears the line
    t.expect(b"> ")
    t.send(b"Hello there\r")            # ... and must not stop this reply
    reply = t.expect(b"> ")
    assert b"4 generated" in reply and b"[stopped]" not in reply, reply
    t.send(b"/nope\r")
    assert b"unknown command /nope" in t.expect(b"> ")
    t.send(b"\x04")                     # Ctrl-D: leave, after a newline
    assert t.proc.wait(timeout=60) == 0
    assert t.rest().startswith(b"\r\n"), t.out  # the shell's prompt starts on a line of its own
    t.close()


@pytest.mark.timeout(600)
def test_chat_at_a_terminal_says_what_it_drops_and_keeps_one_stats_line(tmp_path):
    args = _clutor("chat", MODEL, "-c", "96", "-n", "30", "--temperature", "0", "--ignore-eos")
    t = _Pty(args, _env(HOME=str(tmp_path)))
    assert b"the file's chat template" in t.expect(b"> ")  # which template renders the conversation
    t.send(b"one two three four five six seven eight nine ten\r")
    first = t.expect(b"> ")
    assert first.count(b"generated") == 1 and b"/stats for more]" in first and b"dropped" not in first, first
    assert b"peak RSS" not in first  # one short line per reply ...
    t.send(b"alpha beta gamma delta epsilon zeta eta theta\r")
    second = t.expect(b"> ")
    assert b"dropped the 2 oldest messages to fit the 96-token context" in second, second
    t.send(b"/stats\r")
    assert b"peak RSS" in t.expect(b"> ")  # ... and the rest on asking
    t.send(b"/exit\r")
    assert t.proc.wait(timeout=60) == 0
    t.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("when", ["while it streams", "with the message"])
def test_ctrl_d_during_a_reply_leaves_after_it(tmp_path, when):
    args = _clutor("chat", MODEL, "-n", "300", "--temperature", "0", "--ignore-eos")
    t = _Pty(args, _env(HOME=str(tmp_path)))
    t.expect(b"> ")
    if when == "with the message":  # typed ahead before the reply began
        t.send(b"Tell me a story\r\x04")
    else:
        t.send(b"Tell me a story\r")
        t.expect(b"Tell me a story\r\n")
        t.more()  # the reply has begun
        t.send(b"\x04")
    assert t.proc.wait(timeout=240) == 0
    rest = t.rest()
    assert b"300 generated" in rest and b"[stopped]" not in rest, rest  # the reply ran to its end ...
    assert not rest.rstrip().endswith(b">"), rest                    # ... and no prompt came after it
    t.close()


def test_kernel_compile_is_announced_on_a_terminal(monkeypatch):
    import io

    from clutor.cli.common import warm_kernels
    from clutor.model import kernels

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(kernels, "warmup", lambda **_: time.sleep(3.5))  # a first run's compile, shortened
    warm_kernels()
    assert "compiling the compute kernels" in err.getvalue() and err.getvalue().endswith("\r\x1b[K")
    err.seek(0)
    err.truncate()
    monkeypatch.setattr(kernels, "warmup", lambda **_: None)  # cached: nothing said
    warm_kernels()
    assert err.getvalue() == ""
