"""What one request may make the cluster do, counted before any of it is done.

A request's ``RequestCost`` is read from its engine requests: every prompt with each of its
``n`` choices may compute its prompt and produce ``max_tokens`` (``tokens``), and a scored
prompt (``echo`` with logprobs, ``prompt_logprobs``) is scored once for all its choices
(``scored``; the ingress holds each scored token's top logprobs until the response goes out).
``check`` refuses a request over ``Limits.max_request_tokens`` or ``Limits.max_scored_tokens``
with a 400 naming the limit; ``TenantQuotas.charge`` draws ``tokens`` from its tenant's
``tenant_tokens_per_minute``.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.request import GenerationRequest
from deploy.errors import APIError
from deploy.limits import Limits

__all__ = ["RequestCost"]


@dataclass(frozen=True, slots=True)
class RequestCost:
    tokens: int  # prompt + max_tokens, over every prompt and each of its n choices
    scored: int  # prompt tokens scored, each prompt once

    @classmethod
    def of(cls, engine_reqs: list[GenerationRequest], n: int) -> RequestCost:
        tokens = sum(n * (len(r.prompt_ids) + r.max_tokens) for r in engine_reqs)
        scored = sum(len(r.prompt_ids) for r in engine_reqs if r.sampling.prompt_logprobs is not None)
        return cls(tokens, scored)

    def check(self, limits: Limits) -> None:
        """A 400 naming the limit this request is over, if any."""
        if self.tokens > limits.max_request_tokens:
            raise APIError(400, f"the request may cost {self.tokens} tokens (each prompt's tokens and max_tokens, times "
                                f"n, over the batch), over the limit of {limits.max_request_tokens} "
                                f"(limits.max_request_tokens); send fewer prompts, a smaller n or max_tokens",
                           code="request_too_large")
        if self.scored > limits.max_scored_tokens:
            raise APIError(400, f"the request scores {self.scored} prompt tokens (echo with logprobs, prompt_logprobs), "
                                f"over the limit of {limits.max_scored_tokens} (limits.max_scored_tokens)",
                           code="request_too_large")
