"""Pipeline parallelism's split of the model: which decoder layers each stage holds.

Stage ``s`` of ``P`` holds a contiguous run of layers; the first ``L mod P`` stages hold
one layer more. Every stage keeps the (small) embedding, final norm and LM head
weights, but only the first embeds and only the last computes logits. Between stages
one tensor travels per step: the residual stream ``[T, hidden]`` after the stage's last
layer (``engine.runner.PipelineLinks``)."""

from __future__ import annotations


def stage_layers(num_layers: int, num_stages: int, stage: int) -> range:
    """The layers stage ``stage`` of ``num_stages`` holds."""
    if not 0 < num_stages <= num_layers:
        raise ValueError(
            f"pipeline_parallel_size {num_stages} must be between 1 and the model's "
            f"{num_layers} layers"
        )
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))
