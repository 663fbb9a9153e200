"""Built-in chat templates for GGUF files that carry none.

Some published GGUF files have no ``tokenizer.chat_template`` (conversions of Gemma 3,
for one). llama.cpp's server still answers chat requests on them with a prompt format it
knows; so does structllm, with the format of the model's family, told by the file's
architecture (``ModelConfig.architecture``, the family ``registry`` reads from
``general.architecture``) and by the special tokens its vocabulary holds: a format is
taken only when every marker it writes is one token of the vocabulary, so the prompt
is what the model was trained on and not the markers spelled out as text. Which
formats, and what they write, follow llama.cpp's built-in ones (``src/llama-chat.cpp``):

- ``gemma`` (gemma2, gemma3): ``<start_of_turn>user`` ... ``<end_of_turn>``, the
  assistant as ``model``, a system message merged into the next user turn;
- ``gemma4`` (gemma4): ``<|turn>user`` ... ``<turn|>``, the assistant as ``model``, a
  leading system message as a ``system`` turn, the answer opened with an empty thought
  channel (``<|channel>thought\n<channel|>``), as Gemma 4's own template writes it with
  thinking off (llama.cpp has no built-in one: this follows the published template,
  ``models/templates/google-gemma-4-31B-it.jinja`` in its tree, without tools);
- ``chatml`` (qwen2, qwen3, qwen3_moe, smollm3, olmo2/3, stablelm, and any family whose vocabulary
  has ``<|im_start|>`` and ``<|im_end|>``, e.g. SmolLM2's llama files);
- ``llama3`` (llama files with ``<|start_header_id|>``, ``<|end_header_id|>``,
  ``<|eot_id|>``);
- ``mistral-v7`` / ``mistral-v3`` / ``mistral-v1`` (mistral, mixtral, and llama files
  with ``[INST]`` tokens): ``[SYSTEM_PROMPT]`` when it is a token, ``[INST]`` as a
  token, or ``[INST]`` as text (Mistral 7B / Mixtral v0.1, whose vocabulary has none);
- ``phi3`` (phi3): ``<|user|>`` ... ``<|end|>``;
- ``granite`` (granite): ``<|start_of_role|>user<|end_of_role|>`` ... ``<|end_of_text|>``;
- ``command-r`` (cohere, cohere2): ``<|START_OF_TURN_TOKEN|><|USER_TOKEN|>`` ...
  ``<|END_OF_TURN_TOKEN|>``, the assistant as ``<|CHATBOT_TOKEN|>``.

The templates are Jinja, rendered like any model's (``Tokenizer.apply_chat_template``);
they write ``bos_token`` first when the file asks for a BOS token (``add_bos_token``), as
llama.cpp's tokenization of the prompt does. A format's end-of-turn token
(``FamilyTemplate.end_of_turn``) also ends generation, as llama.cpp's end-of-generation
tokens do. Sans-IO: no files are read here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class FamilyTemplate:
    """A built-in chat template chosen for a model: its ``name``, the Jinja ``template``,
    the token that ends an assistant turn (``None``: the model's EOS), and ``reason``,
    why it was chosen (for the start-up line)."""

    name: str
    template: str
    end_of_turn: str | None
    reason: str


@dataclass(frozen=True)
class _Format:
    name: str
    template: str
    tokens: tuple[str, ...]  # markers that must be tokens of the vocabulary
    end_of_turn: str | None


def _loop(body: str, generation_prompt: str) -> str:
    """A template that renders ``body`` for each message ``m`` and then, when asked,
    ``generation_prompt`` (both Jinja expressions)."""
    return (
        "{%- for m in messages %}{{- " + body + " }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- " + generation_prompt + " }}{%- endif %}"
    )


_CHATML = _loop(
    "'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'",
    "'<|im_start|>assistant\\n'",
)

_LLAMA3 = _loop(
    "'<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + (m['content'] | trim)"
    " + '<|eot_id|>'",
    "'<|start_header_id|>assistant<|end_header_id|>\\n\\n'",
)

_PHI3 = _loop("'<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n'", "'<|assistant|>\\n'")

_GRANITE = _loop(
    "'<|start_of_role|>' + m['role'] + '<|end_of_role|>' + m['content'] + '<|end_of_text|>\\n'",
    "'<|start_of_role|>assistant<|end_of_role|>'",
)

# Gemma has no system turn: system text goes at the head of the next user turn.
_GEMMA = (
    "{%- set ns = namespace(system='') %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}"
    "{%- set ns.system = ns.system + (m['content'] | trim) %}"
    "{%- else %}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' }}"
    "{%- if ns.system and role != 'model' %}"
    "{{- ns.system + '\\n\\n' }}{%- set ns.system = '' %}"
    "{%- endif %}"
    "{{- (m['content'] | trim) + '<end_of_turn>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)


def _mistral(lead: str, trail: str, trim_answers: bool) -> str:
    """Mistral's v1 (``lead`` " ") and v3 (``lead`` ""): a user turn opens with
    ``[INST]`` unless one is open (a system message opens it too, its text followed by a
    blank line), an answer closes it with EOS."""
    answer = "(m['content'] | trim)" if trim_answers else "m['content']"
    return (
        "{%- set ns = namespace(open=false) %}"
        "{%- for m in messages %}"
        "{%- if not ns.open %}{{- '" + lead + "[INST]" + trail + "' }}"
        "{%- set ns.open = true %}{%- endif %}"
        "{%- if m['role'] == 'system' %}{{- m['content'] + '\\n\\n' }}"
        "{%- elif m['role'] == 'user' %}{{- m['content'] + '" + lead + "[/INST]' }}"
        "{%- else %}{{- '" + trail + "' + " + answer + " + eos_token }}"
        "{%- set ns.open = false %}{%- endif %}"
        "{%- endfor %}"
    )


_MISTRAL_V7 = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}{{- '[SYSTEM_PROMPT] ' + m['content'] + '[/SYSTEM_PROMPT]' }}"
    "{%- elif m['role'] == 'user' %}{{- '[INST] ' + m['content'] + '[/INST]' }}"
    "{%- else %}{{- ' ' + m['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}"
)

# Command R's turns (llama.cpp's "command-r"): the role's token after the turn's start
_COMMAND_R = _loop(
    "'<|START_OF_TURN_TOKEN|><|' + {'system': 'SYSTEM', 'user': 'USER', 'assistant':"
    " 'CHATBOT'}[m['role']] + '_TOKEN|>' + (m['content'] | trim) + '<|END_OF_TURN_TOKEN|>'",
    "'<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>'",
)

# Gemma 4: a leading system (or developer) message is a turn of its own; each turn's
# text trimmed; the answer opens with an empty thought channel (thinking off)
_GEMMA4 = (
    "{%- set ns = namespace(skip=0) %}"
    "{%- if messages and messages[0]['role'] in ['system', 'developer'] %}"
    "{{- '<|turn>system\\n' + (messages[0]['content'] | trim) + '<turn|>\\n' }}"
    "{%- set ns.skip = 1 %}"
    "{%- endif %}"
    "{%- for m in messages[ns.skip:] %}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{- '<|turn>' + role + '\\n' + (m['content'] | trim) + '<turn|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|turn>model\\n<|channel>thought\\n<channel|>' }}"
    "{%- endif %}"
)

CHATML = _Format("chatml", _CHATML, ("<|im_start|>", "<|im_end|>"), "<|im_end|>")
GEMMA = _Format("gemma", _GEMMA, ("<start_of_turn>", "<end_of_turn>"), "<end_of_turn>")
GEMMA4 = _Format("gemma4", _GEMMA4, ("<|turn>", "<turn|>", "<|channel>", "<channel|>"), "<turn|>")
LLAMA3 = _Format(
    "llama3", _LLAMA3, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "<|eot_id|>"
)
MISTRAL_V7 = _Format(
    "mistral-v7", _MISTRAL_V7, ("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]"), None
)
MISTRAL_V3 = _Format("mistral-v3", _mistral("", " ", True), ("[INST]", "[/INST]"), None)
MISTRAL_V1 = _Format("mistral-v1", _mistral(" ", " ", False), (), None)  # [INST] as text
PHI3 = _Format("phi3", _PHI3, ("<|user|>", "<|assistant|>", "<|end|>"), "<|end|>")
COMMAND_R = _Format(
    "command-r",
    _COMMAND_R,
    ("<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>")
    + ("<|SYSTEM_TOKEN|>",),
    "<|END_OF_TURN_TOKEN|>",
)
GRANITE = _Format(
    "granite", _GRANITE, ("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"), None
)

FORMATS: tuple[_Format, ...] = (
    CHATML,
    GEMMA,
    GEMMA4,
    LLAMA3,
    MISTRAL_V7,
    MISTRAL_V3,
    MISTRAL_V1,
    PHI3,
    GRANITE,
    COMMAND_R,
)

# Each family's own formats, the first whose markers are all tokens wins. After them,
# any family whose vocabulary has ChatML's tokens gets ChatML.
FAMILY_FORMATS: dict[str, tuple[_Format, ...]] = {
    "gemma2": (GEMMA,),
    "gemma3": (GEMMA,),
    "gemma4": (GEMMA4,),
    "qwen2": (CHATML,),
    "qwen3": (CHATML,),
    "qwen3_moe": (CHATML,),
    "smollm3": (CHATML,),
    "olmo2": (CHATML,),
    "olmo3": (CHATML,),
    "stablelm": (CHATML,),  # StableLM 2's chat models
    # Llama 3's headers, else a Mistral written as llama by llama.cpp's converter
    "llama": (LLAMA3, MISTRAL_V7, MISTRAL_V3),
    "mistral": (MISTRAL_V7, MISTRAL_V3, MISTRAL_V1),
    "mixtral": (MISTRAL_V7, MISTRAL_V3, MISTRAL_V1),
    "phi3": (PHI3,),
    "granite": (GRANITE,),
    "cohere": (COMMAND_R,),
    "cohere2": (COMMAND_R,),
}


def family_template(
    family: str, has_token: Callable[[str], bool], add_bos: bool
) -> FamilyTemplate | None:
    """The built-in template for a model of ``family`` (``ModelConfig.architecture``)
    whose vocabulary holds exactly the tokens ``has_token`` accepts; ``None`` when no
    format fits. ``add_bos``: the template writes ``bos_token`` first."""
    own = FAMILY_FORMATS.get(family, ())
    for fmt in (*own, CHATML):
        if not all(has_token(t) for t in fmt.tokens):
            continue
        tokens = " ".join(fmt.tokens)
        if fmt in own:
            reason = f"the {family} family's format" + (
                f", its markers {tokens} in the vocabulary" if tokens else ""
            )
        else:
            reason = f"ChatML's {tokens} in the vocabulary of this {family} file"
        template = ("{{- bos_token }}" if add_bos else "") + fmt.template
        return FamilyTemplate(fmt.name, template, fmt.end_of_turn, reason)
    return None
