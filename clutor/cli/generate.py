"""clutor generate MODEL PROMPT: stream a continuation to stdout, stats to stderr."""
from __future__ import annotations


from ..errors import ClutorError
from .common import (add_command, add_model_args, add_sampling_args, check_sampling_args, model_kwargs, print_stats,
                     read_stdin, read_text_file, sampling_kwargs, warm_kernels, write_out)
from .source import add_model_source


def add_parser(sub):
    p = add_command(sub, "generate", "generate text from a prompt", __doc__,
                    "clutor generate olmoe.gguf 'The capital of France is' -n 32 --temperature 0",
                    "echo 'Write a haiku' | clutor generate qwen3.gguf - --chat",
                    "clutor generate olmoe.gguf -f prompt.txt -n -1")
    add_model_source(p)
    p.add_argument("prompt", nargs="?", default=None, help="prompt text, or - to read it from stdin")
    p.add_argument("-p", "--prompt", dest="prompt_opt", default=None, metavar="TEXT", help="prompt text (as llama.cpp)")
    p.add_argument("-f", "--file", default=None, metavar="FILE", help="read the prompt from FILE")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn")
    p.add_argument("-sys", "--system-prompt", "--system", dest="system", default=None, metavar="TEXT",
                   help="a system message before the prompt (implies --chat)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file to use instead of the model's (implies --chat)")
    p.add_argument("--special", action="store_true", help="parse control tokens written in the prompt")
    add_sampling_args(p)
    add_model_args(p)
    return p


def _prompt(args) -> str:
    given = [x for x in (args.prompt, args.prompt_opt, args.file) if x is not None]
    if len(given) != 1:
        raise ClutorError("give the prompt once: as PROMPT (- for stdin), -p TEXT or -f FILE")
    if args.file is not None:
        return read_text_file(args.file, "prompt file")
    text = args.prompt if args.prompt is not None else args.prompt_opt
    return read_stdin() if text == "-" else text


def run(args):
    check_sampling_args(args)
    prompt = _prompt(args)
    template = read_text_file(args.chat_template, "chat template") if args.chat_template else None
    warm_kernels()
    return _generate(args, prompt, template)


async def _generate(args, prompt: str, template: str | None) -> int:
    from ..model.chat import chat_ids
    from ..model.model import Model

    async with Model.open(args.model, **model_kwargs(args)) as model:
        special = args.special
        if args.chat or template is not None or args.system is not None:
            messages = [{"role": "system", "content": args.system}] if args.system is not None else []
            # (--special: the prompt's own control-token texts are tokens too)
            prompt = chat_ids(model.tokenizer, messages + [{"role": "user", "content": prompt}], template=template,
                              name=args.chat_template or "tokenizer.chat_template", special_in_content=args.special)
        async for out in model.generate(prompt, special=special, **sampling_kwargs(args, model.n_ctx)):
            if out.text:
                write_out(out.text)
            if out.stats:
                print_stats(out.stats)
    return 0
