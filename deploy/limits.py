"""What a caller may do: its API key's grant (tenant and models) and the ingress's limits."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["KeyGrant", "Limits"]


@dataclass(frozen=True, slots=True)
class KeyGrant:
    """What an API key may do: its tenant (whose salt isolates its cache) and the models it may
    use (None: all)."""

    tenant: str
    models: frozenset[str] | None = None

    @classmethod
    def parse(cls, value: str) -> KeyGrant:
        """``TENANT`` or ``TENANT:MODEL[+MODEL...]`` (the value of ``api_keys``, ``--api-key``
        and ``TIDE_API_KEYS`` after the key)."""
        tenant, sep, models = value.partition(":")
        names = frozenset(m for m in models.split("+") if m)
        if not tenant or (sep and not names):
            raise ValueError(f"API key grant {value!r} must be TENANT or TENANT:MODEL[+MODEL...]")
        return cls(tenant, names if sep else None)

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models

class Limits(BaseModel):
    """The ingress's input limits (``limits:`` in the app's args); a misspelled or negative one
    is an error, not a silent default."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(default=4 << 20, ge=1)
    body_timeout_s: float = Field(default=30.0, gt=0)  # a body must arrive whole within this (408)
    max_prompt_tokens: int = Field(default=32768, ge=1)
    max_tokens: int = Field(default=4096, ge=1)
    max_stop: int = Field(default=4, ge=0)
    max_stop_token_ids: int = Field(default=64, ge=0)
    max_n: int = Field(default=8, ge=1)  # choices per request (OpenAI's n)
    max_prompts: int = Field(default=64, ge=1)  # prompts of one /v1/completions batch
    max_logit_bias: int = Field(default=1024, ge=0)  # tokens one request may bias
    max_grammar_bytes: int = Field(default=65536, ge=1)  # a structured output's schema, regex, grammar or choices
    # a request's templates, tokenizing and grammar checks run on a pool of prep_workers threads,
    # at most tenant_prep_concurrency of one tenant's at once (deploy.prep_pool)
    prep_workers: int = Field(default=4, ge=1)
    tenant_prep_concurrency: int = Field(default=2, ge=1)
    # stored Responses (deploy.response_store): how long one is kept, its largest size (its
    # conversation included; a larger one is not kept), and how many a tenant keeps
    stored_response_ttl_s: int = Field(default=30 * 86400, ge=1)
    max_stored_response_bytes: int = Field(default=4 << 20, ge=1)
    max_stored_responses: int = Field(default=10000, ge=1)
    # a request's cost (deploy.request_cost): prompt + max_tokens over its prompts and n choices,
    # and prompt tokens scored (echo with logprobs, prompt_logprobs; each prompt once)
    max_request_tokens: int = Field(default=262144, ge=1)
    max_scored_tokens: int = Field(default=32768, ge=0)
    # per tenant and ingress replica, 0: off; over either a request is a 429 with Retry-After
    tenant_requests_per_minute: int = Field(default=0, ge=0)
    tenant_burst: int = Field(default=0, ge=0)  # requests a tenant may send at once (0: a second's worth)
    tenant_concurrency: int = Field(default=0, ge=0)  # a tenant's requests under way at once
    tenant_tokens_per_minute: int = Field(default=0, ge=0)  # request costs' tokens a tenant may draw
    # the Files and Batch APIs (deploy.ingress.batches): an upload's size, how long a file is
    # kept by default (OpenAI's: 30 days), a batch's lines and tokens (its lines' costs, as
    # above, summed), a tenant's batches not ended and their tokens, and the lines one ingress
    # replica runs at once (the replicas run them behind interactive requests)
    max_file_bytes: int = Field(default=200 << 20, ge=1)
    file_ttl_s: int = Field(default=30 * 86400, ge=3600)
    max_batch_lines: int = Field(default=50000, ge=1)
    max_batch_tokens: int = Field(default=50_000_000, ge=1)
    max_tenant_batches: int = Field(default=100, ge=1)
    tenant_batch_tokens: int = Field(default=0, ge=0)  # 0: no per-tenant bound beyond max_tenant_batches
    batch_concurrency: int = Field(default=16, ge=1)
