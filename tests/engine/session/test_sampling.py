"""SamplingParams validation and the mlx-lm samplers built from it."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine.errors import EngineError
from engine.session.sampling import (
    REPETITION_CONTEXT,
    SamplingParams,
    build_logits_processors,
    build_sampler,
    draw_seed,
)

LOGITS = mx.array([[0.1, 3.0, 2.5, -1.0, 2.9, 0.0]])
LOGPROBS = LOGITS - mx.logsumexp(LOGITS, keepdims=True)


def _draws(params: SamplingParams, n: int = 200) -> set[int]:
    sampler = build_sampler(params)
    if params.seed is not None:
        mx.random.seed(params.seed)
    return {int(sampler(LOGPROBS).item()) for _ in range(n)}


def test_defaults_match_the_worker_contract() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.7, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.max_tokens, p.seed) == (1.0, 512, None)


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1),
     ("min_p", 1.0), ("repetition_penalty", 0.0), ("max_tokens", 0), ("logprobs", -1)],
)
def test_invalid_settings_raise_an_engine_error_naming_the_field(field: str, value) -> None:
    with pytest.raises(EngineError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty",
                                   "presence_penalty", "frequency_penalty"])
def test_a_setting_that_is_not_a_finite_number_is_refused(field: str, value: float) -> None:
    # NaN passed every range check: the answer came out as one token repeated.
    with pytest.raises(EngineError, match=f"{field} must be a finite number"):
        SamplingParams(**{field: value})
    with pytest.raises(EngineError, match=r"logit_bias\[7\] must be a finite number"):
        SamplingParams(logit_bias=((7, value),))


def test_temperature_zero_is_greedy() -> None:
    assert _draws(SamplingParams(temperature=0.0), 5) == {1}


def test_a_temperature_too_small_to_invert_is_greedy() -> None:
    # 1/1e-39 overflows float32: the scaled logits were all infinite, the draw uniform.
    assert _draws(SamplingParams(temperature=1e-39, seed=3), 40) == {1}


def test_top_k_limits_the_candidates() -> None:
    assert _draws(SamplingParams(temperature=5.0, top_k=2, seed=1)) == {1, 4}
    assert len(_draws(SamplingParams(temperature=5.0, seed=1))) > 2


def test_top_p_and_min_p_drop_unlikely_tokens() -> None:
    assert _draws(SamplingParams(temperature=1.0, min_p=0.5, seed=2)) <= {1, 2, 4}
    assert _draws(SamplingParams(temperature=1.0, top_p=0.3, seed=3)) <= {1, 4}


def test_a_seeded_answers_draws_have_seeds_of_their_own() -> None:
    seeds = [draw_seed(7, draw) for draw in range(100)]
    assert seeds == [draw_seed(7, draw) for draw in range(100)]  # the same seed, the same
    assert len(set(seeds)) == 100 and not set(seeds) & {draw_seed(8, d) for d in range(100)}
    assert all(0 <= seed < 2**64 for seed in seeds)  # what mx.random.seed takes


def test_repetition_penalty_lowers_recent_tokens_only() -> None:
    assert build_logits_processors(SamplingParams()) == []
    (processor,) = build_logits_processors(SamplingParams(repetition_penalty=2.0))
    out = processor(mx.array([1, 3]), mx.array(LOGITS))
    assert out[0, 1].item() == pytest.approx(1.5)   # positive logit divided
    assert out[0, 3].item() == pytest.approx(-2.0)  # negative logit multiplied
    assert out[0, 2].item() == pytest.approx(2.5)   # untouched
    assert REPETITION_CONTEXT >= 20


def test_presence_frequency_and_bias_shift_the_logits() -> None:
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25,
                            logit_bias=((0, 10.0), (2, -100.0)))
    out = mx.array(LOGITS)
    for processor in build_logits_processors(params):
        out = processor(mx.array([1, 1, 3]), out)
    assert out[0, 0].item() == pytest.approx(10.1)   # biased up
    assert out[0, 2].item() == pytest.approx(-97.5)  # biased down
    assert out[0, 1].item() == pytest.approx(3.0 - 0.5 - 2 * 0.25)  # seen twice
    assert out[0, 3].item() == pytest.approx(-1.0 - 0.5 - 0.25)     # seen once
    assert out[0, 4].item() == pytest.approx(2.9)    # never seen


def test_logprobs_beyond_the_limit_are_refused() -> None:
    with pytest.raises(EngineError, match="logprobs"):
        SamplingParams(logprobs=21)
