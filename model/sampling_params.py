"""What a request asks of sampling (``SamplingParams``) and what it gets back per token
(``TokenLogprob``): plain values, importable without torch (the router, the API models and the
admin commands use them)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["GREEDY_BELOW", "MAX_LOGIT_BIAS", "MAX_LOGPROBS", "MAX_REPETITION_PENALTY", "SamplingParams", "TOP_P_FLOOR",
           "TokenLogprob"]

MAX_LOGPROBS = 20  # top alternatives a request may ask for per token (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 100.0  # |bias| a request may add to a token's logit (OpenAI's range)
MAX_REPETITION_PENALTY = 10.0
# Below float32's resolution a temperature or a top_p would be 0 where the sampler computes: a
# temperature under GREEDY_BELOW samples greedily, a top_p under TOP_P_FLOOR is TOP_P_FLOOR (the
# most likely token alone either way)
GREEDY_BELOW = 1e-5
TOP_P_FLOOR = 1e-6


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    logprobs: int | None = None  # None: off; k: each chosen token's logprob and the k most likely
    # OpenAI's penalties on the tokens generated so far: each token's logit drops by
    # presence_penalty once it has appeared and by frequency_penalty per appearance
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # OpenAI's logit_bias: (token id, bias) pairs added to those tokens' logits at every step
    # (+100 all but forces a token, -100 all but bans it)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's (and transformers'): a token of the prompt or the output so far has its logit divided
    # by this when positive, multiplied when negative (1: off)
    repetition_penalty: float = 1.0
    # tokens less likely than min_p times the most likely token's probability are not drawn (0: off)
    min_p: float = 0.0
    # None: off; k: each prompt token's logprob given the tokens before it, and the k most likely
    # there (the first token has none). The prompt is computed whole: no cached prefix is reused.
    prompt_logprobs: int | None = None
    # greedy, with no bias or penalty: the token is the logits' argmax (set from the above)
    plain_greedy: bool = field(init=False, repr=False, compare=False, default=False)

    def __post_init__(self) -> None:
        for token, bias in self.logit_bias:
            if token < 0:
                raise ValueError(f"logit_bias token id must be >= 0, got {token}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias of token {token} must be in [-100, 100], got {bias}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        object.__setattr__(self, "top_p", max(self.top_p, TOP_P_FLOOR))
        object.__setattr__(self, "plain_greedy",
                           self.greedy and not self.logit_bias and not self.penalized and not self.repeats)

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def repeats(self) -> bool:
        """The repetition penalty is on: the prompt's tokens count too."""
        return self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A chosen token's log-probability under the model (the raw distribution, before
    logit bias, penalties, temperature, top-k and top-p) and the ``top`` most likely tokens with theirs, most
    likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int = 0  # the token's place by likelihood (1: the most likely) where computed (a prompt's), else 0
