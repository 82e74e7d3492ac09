"""clutor generate MODEL PROMPT: stream a continuation to stdout, stats to stderr."""
from __future__ import annotations

import sys

from .common import Formatter, add_model_args, add_sampling_args, model_kwargs, print_stats, sampling_kwargs


def add_parser(sub):
    p = sub.add_parser(
        "generate", help="generate text from a prompt", formatter_class=Formatter,
        description=__doc__,
        epilog="examples:\n  clutor generate olmoe.gguf 'The capital of France is' -n 32 --temperature 0\n"
               "  echo 'Write a haiku' | clutor generate qwen3.gguf - --chat",
    )
    p.add_argument("model", help="GGUF file (first part of a split model)")
    p.add_argument("prompt", help="prompt text, or - to read it from stdin")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn")
    p.add_argument("--special", action="store_true", help="parse control tokens written in the prompt")
    add_sampling_args(p)
    add_model_args(p)
    return p


async def run(args) -> int:
    from ..model.chat import chat_prompt
    from ..model.model import Model

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    async with Model.open(args.model, **model_kwargs(args)) as model:
        special = args.special
        if args.chat:
            prompt = chat_prompt(model.tokenizer, [{"role": "user", "content": prompt}])
            special = True
        async for out in model.generate(prompt, special=special, **sampling_kwargs(args)):
            if out.text:
                sys.stdout.write(out.text)
                sys.stdout.flush()
            if out.stats:
                print_stats(out.stats)
    return 0
