"""What models write besides text: reasoning and tool calls, per family, parsed as they stream.

    fam = family_for(tokenizer.chat_template)        # e.g. the Qwen3-Coder XML form
    p = fam.parser(tools, think=think_tags(template), starts_in_reasoning=...)
    for piece in text_stream: delta = p.feed(piece)  # content / reasoning / tool-call deltas
    p.finish(); p.message                            # the whole reply

Families: Hermes ``<tool_call>`` JSON (Qwen2.5/3), the XML function form (Qwen3-Coder, Qwen3.5),
gpt-oss harmony, GLM-4.5 ``<arg_key>``, DeepSeek-V3.1's tool-call tokens, Mistral ``[TOOL_CALLS]``
(both forms), Gemma 4's ``<|tool_call>call:``, MiniMax-M2's ``<invoke>`` XML, Llama 4's JSON. A template with none of their markup gets Hermes calls, described in the system prompt.
"""
from __future__ import annotations

from .base import CallDelta, Delta, Message, StreamParser, Tool, ToolCall
from .deepseek import DEEPSEEK
from .family import Family
from .gemma4 import GEMMA4
from .glm import GLM
from .harmony import HARMONY
from .hermes import HERMES, HERMES_FALLBACK
from .llama4 import LLAMA4
from .minimax import MINIMAX_M2
from .mistral import MISTRAL, MISTRAL_ARGS
from .qwen_xml import QWEN_XML

__all__ = ["CallDelta", "Delta", "Message", "StreamParser", "Tool", "ToolCall", "Family", "FAMILIES", "family_for",
           "think_tags", "starts_in_reasoning", "THINK", "HARMONY", "QWEN_XML", "GLM", "DEEPSEEK", "MISTRAL",
           "MISTRAL_ARGS", "HERMES", "HERMES_FALLBACK", "GEMMA4", "MINIMAX_M2", "LLAMA4"]

# In detection order: the first whose markup the template writes wins.
FAMILIES: tuple[Family, ...] = (HARMONY, GEMMA4, MINIMAX_M2, LLAMA4, QWEN_XML, GLM, DEEPSEEK, MISTRAL_ARGS, MISTRAL,
                                HERMES)
THINK = ("<think>", "</think>")


def family_for(template: str | None) -> Family:
    """The family whose tool-call markup ``template`` writes (Hermes, described in the system prompt,
    when it writes none)."""
    for f in FAMILIES:
        if template and f.detect(template):
            return f
    return HERMES_FALLBACK


def think_tags(template: str | None) -> tuple[str, str] | None:
    """The reasoning block's tags when the template knows them (Qwen3, DeepSeek, GLM, MiniMax-M2; Gemma 4's
    thought channel), else None. (harmony keeps reasoning in its analysis channel: its parser splits it.)"""
    if template and GEMMA4.detect(template):
        return GEMMA4.think
    return THINK if template and (THINK[0] in template or THINK[1] in template) else None


def starts_in_reasoning(prompt: str, think: tuple[str, str] | None) -> bool:
    """Whether the prompt leaves a reasoning block open (the template wrote '<think>' for the model)."""
    if think is None:
        return False
    tail = prompt.rstrip()
    return tail.endswith(think[0])
