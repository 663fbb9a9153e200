"""What a harmony request asks of the engine beyond its own sampling parameters: to stop
at ``<|call|>`` (a call is written) and ``<|return|>`` (the answer is done), and where a
constraint starts: after the final channel's header (``<|channel|>final<|message|>``),
as vLLM's ``openai_gptoss`` reasoning parser has it, unless the constraint is a grammar
that writes harmony's markers itself (then it covers the whole reply). Shared by the
server and the offline ``LLM.chat``."""

from __future__ import annotations

import msgspec

from structllm.harmony.render import CALL, CHANNEL, MARKERS, MESSAGE, RETURN
from structllm.protocol import Reasoning, SamplingParams
from structllm.tokenizer import Tokenizer

FINAL_HEADER = CHANNEL + "final" + MESSAGE


def for_harmony(sp: SamplingParams, tokenizer: Tokenizer) -> SamplingParams:
    """``sp`` with harmony's stop tokens added and its constraint's start set."""
    stops = [t for t in map(tokenizer.token_id, (CALL, RETURN)) if t is not None]
    spec = sp.structured_outputs
    reasoning = None
    if spec is not None and not (
        spec.grammar is not None and any(m in spec.grammar for m in MARKERS)
    ):
        end = tokenizer.encode(FINAL_HEADER, add_special_tokens=False)
        reasoning = Reasoning(end_token_ids=end)
    new_stops = [*sp.stop_token_ids, *(t for t in stops if t not in sp.stop_token_ids)]
    return msgspec.structs.replace(sp, stop_token_ids=new_stops, reasoning=reasoning)
