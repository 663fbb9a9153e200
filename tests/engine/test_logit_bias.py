"""``SamplingParams.logit_bias``: validation, the sampler, and the real model."""

from __future__ import annotations

import pytest
import torch

from structllm import LLM, SamplingParams
from structllm.engine.request import Request
from structllm.engine.sampler import Sampler

V = 32


def r(**sp: object) -> Request:
    return Request("x", [1, 2, 3], SamplingParams(max_tokens=100, **sp), 100)  # type: ignore[arg-type]


def rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed))


# -- validation -------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [{3: 100.5}, {3: -101.0}, {3: float("nan")}, {-1: 1.0}])
def test_bad_bias_is_refused_naming_the_field(bias: dict[int, float]) -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_check_vocab_names_the_field() -> None:
    SamplingParams(logit_bias={31: 1.0}, stop_token_ids=[31]).check_vocab(32)
    with pytest.raises(ValueError, match=r"^SamplingParams\.logit_bias contains token id 32"):
        SamplingParams(logit_bias={32: 1.0}).check_vocab(32)
    with pytest.raises(ValueError, match=r"^SamplingParams\.stop_token_ids contains token id 40"):
        SamplingParams(stop_token_ids=[40]).check_vocab(32)


def test_bias_bounds_are_accepted() -> None:
    assert SamplingParams(logit_bias={0: -100.0, 5: 100}).logit_bias == {0: -100.0, 5: 100}


# -- sampler ----------------------------------------------------------------------------


def test_minus_100_bans_the_greedy_token() -> None:
    logits = rows(1)
    top = int(logits[0].argmax())
    tokens, _ = Sampler([0])(logits.clone(), [r(temperature=0, logit_bias={top: -100.0})])
    assert tokens[0] != top
    assert tokens[0] == int(logits[0].masked_fill(torch.arange(V) == top, -1e9).argmax())


def test_plus_100_forces_a_token_even_when_sampling_hot() -> None:
    sampler = Sampler([0], seed=1)
    for s in range(20):
        req = r(temperature=2.0, top_k=5, top_p=0.9, min_p=0.1, seed=s, logit_bias={17: 100.0})
        assert sampler(rows(1, s), [req])[0] == [17]


def test_bias_comes_before_top_k() -> None:
    # the biased token is outside the raw top-1, but top_k=1 keeps it: biased first
    logits = rows(1)
    low = int(logits[0].argmin())
    tokens, _ = Sampler([0])(logits, [r(temperature=1.0, top_k=1, logit_bias={low: 100.0})])
    assert tokens == [low]


def test_bias_does_not_leak_into_other_rows() -> None:
    logits = rows(4)
    plain = logits.argmax(dim=-1).tolist()
    reqs = [
        r(temperature=0),
        r(temperature=0, logit_bias={9: 100.0}),
        r(temperature=0),
        r(temperature=0),
    ]
    tokens, _ = Sampler([0])(logits.clone(), reqs)
    assert tokens == [plain[0], 9, plain[2], plain[3]]


def test_reported_logprobs_are_those_of_the_raw_logits() -> None:
    logits = rows(1)
    top = int(logits[0].argmax())
    raw = torch.log_softmax(logits[0], dim=-1)
    req = r(temperature=0, logprobs=2, logit_bias={top: -100.0, 4: 50.0})
    tokens, lps = Sampler([0])(logits.clone(), [req])
    assert tokens == [4]
    lp = lps[0]
    assert lp is not None and lp.logprob == pytest.approx(raw[4].item())
    assert lp.top_ids[0] == top and lp.top_logprobs[0] == pytest.approx(raw[top].item())


def test_ids_beyond_the_vocabulary_are_skipped() -> None:
    logits = rows(1)
    tokens, _ = Sampler([0])(logits.clone(), [r(temperature=0, logit_bias={V + 5: 100.0})])
    assert tokens == [int(logits[0].argmax())]


# -- the real model ---------------------------------------------------------------------

PROMPT = "The capital city of France is"


@pytest.mark.slow
def test_real_model_bias_bans_forces_and_does_not_leak(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=4)
    base = llm.generate([PROMPT], greedy)[0].token_ids
    first = base[0]
    forced = llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    params = [
        SamplingParams(temperature=0, max_tokens=4, logit_bias={first: -100.0}),
        greedy,
        SamplingParams(temperature=0, max_tokens=4, logit_bias={forced: 100.0}),
        greedy,
    ]
    outs = llm.generate([PROMPT] * 4, params)  # one batch
    assert outs[0].token_ids[0] != first
    assert outs[1].token_ids == base and outs[3].token_ids == base
    assert outs[2].token_ids == [forced] * 4


@pytest.mark.slow
def test_real_model_refuses_ids_outside_the_vocabulary(llm: LLM) -> None:
    vocab = llm.engine.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([PROMPT], SamplingParams(logit_bias={vocab: 1.0}))
    assert llm.generate([PROMPT], SamplingParams(max_tokens=1, logit_bias={vocab - 1: 1.0}))[
        0
    ].token_ids
