"""Requests as the engine sees them, and what it reports back per step."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from cachedir.hashing import Namespace
from cluster.units import UNIT_TOKENS
from model.grammar import GrammarSpec
from model.sampling_params import SamplingParams, TokenLogprob

if TYPE_CHECKING:  # the ingress and the routers use this module without torch
    import torch


__all__ = ["UNIT_TOKENS", "FinishReason", "cache_namespace", "GenerationRequest", "Prefilled", "PlanMismatch", "PrefixPlan", "RequestFailed", "RequestMigrated",
           "RequestOutput", "Sequence", "TokenSources"]


def cache_namespace(mcfg, weights_digest: str, dtype: str | torch.dtype, secret: bytes = b"",
                    weights: str = "fp32", draft_layers: int = 0) -> Namespace:
    """The cache namespace of a model: units never cross architectures, checkpoints, dtypes,
    weight forms (``model.weights_id.weights_form``: int8 or fp8 weights compute other KV) or KV
    layouts (the ingress computes it too, to look a prompt's units up before routing).
    ``dtype``: the model's dtype or its name ("bfloat16"). ``secret``: the cluster's cache secret
    (keys the unit hash and authenticates units). ``draft_layers``: the MTP layers whose latents
    the units carry beside the model's (speculative decoding on)."""
    dtype_name = str(dtype).removeprefix("torch.") + ("" if weights == "fp32" else f"+{weights}-weights")
    layout = mcfg.kv_layout + (f"+mtp:{draft_layers}" if draft_layers else "")
    return Namespace(mcfg.fingerprint(), weights_digest, dtype_name, layout, UNIT_TOKENS, secret=secret)


class RequestMigrated(RuntimeError):
    """The replica gave the request back (its node is leaving serving); the caller continues it
    elsewhere from its prompt and the tokens generated so far."""


class KVLost(ConnectionError):
    """A prompt's KV handed off from a prefill replica cannot be fetched (its replica, its ticket
    or its bytes are gone or bad: ``cluster.kv_transfer``); the caller starts the request over."""


class PlanMismatch(RuntimeError):
    """A prefix plan was made in another cache namespace than the replica's: its unit keys name
    other units, so every planned load would miss."""


class RequestFailed(RuntimeError):
    """This request failed on its own (its sampling or its grammar raised); the others in its
    batch went on."""

    @property
    def request_fault(self) -> bool:
        """Whether the request's own input failed it (its grammar reached a state no output
        continues from): a client error, not the server's."""
        return str(self).startswith("GrammarError:")


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"
    HANDOFF = "handoff"  # prefill done; decoding continues on a decode replica (P/D split)
    ERROR = "error"  # the request failed alone (``RequestOutput.error`` says why)


@dataclass(frozen=True, slots=True)
class PrefixPlan:
    """The prompt cache's plan for one prompt, made once where it enters (the ingress) and shared
    by its choices and retries: the chain keys of every whole 64-token unit of the prompt (from
    token 0, in the tenant's ``namespace``: its id), the live nodes the directory lists for each
    leading unit it found with their agents' ``addresses``, and how many leading units the chosen
    replica loads (``load_units``, set by the cache-aware router, which declines a load slower
    than computing; None: load what the holders have). The replica hashes nothing and asks the
    directory nothing: it loads exactly that, and a unit that turns out to be gone is computed (a
    miss, never wrong KV). A replica of another namespace refuses the plan."""

    unit_keys: tuple[bytes, ...]
    holders: tuple[tuple[str, ...], ...] = ()  # node ids per leading unit found, in order
    load_units: int | None = None
    dropped_next: bool = False  # the unit after those found was dropped by its holders (directory)
    namespace: str = ""  # the id of the namespace the keys were chained in (``Namespace.id``)
    addresses: tuple[tuple[str, str], ...] = ()  # (node id, its agent's address) of the live holders

    def __post_init__(self) -> None:
        if len(self.holders) > len(self.unit_keys):
            raise ValueError(f"{len(self.holders)} holder lists for {len(self.unit_keys)} units")
        if self.load_units is not None and not 0 <= self.load_units <= len(self.holders):
            raise ValueError(f"load_units {self.load_units} is not in [0, {len(self.holders)}]")

    @property
    def loadable(self) -> int:
        """Leading units to load: those the directory found, up to ``load_units``."""
        return len(self.holders) if self.load_units is None else self.load_units


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One request as the engine takes it, and as it crosses to a replica (``LLMServer.generate``);
    an empty ``request_id`` is filled in by the replica."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    tenant: str = ""
    handoff: bool = False  # prefill only: finish with HANDOFF and the prompt's KV after token 1
    prefilled: Prefilled | None = None  # decode only: start from a prefill done elsewhere
    # A request continued on this replica after another gave it back: the output tokens streamed
    # before (they end ``prompt_ids`` too) and how many characters of their text were sent.
    # Detokenization goes on from them, so a character split across the move comes out whole.
    continued_ids: tuple[int, ...] = ()
    continued_chars: int = 0
    # structured output: every step keeps the output a prefix of what the grammar matches
    # (JSON, a schema, a choice, a regex, EBNF), and the request ends when it is whole
    grammar: GrammarSpec | None = None
    plan: PrefixPlan | None = None  # the ingress's prefix plan (None: the engine hashes and looks up)
    # R1: the output is a thought until this token (``</think>``); the grammar constrains the rest
    constrain_after: int | None = None
    # vLLM's: these tokens end the output as EOS does (they are in its tokens, not its text)...
    stop_token_ids: tuple[int, ...] = ()
    # ... and until the output has this many tokens neither they, EOS nor a stop string end it
    # (a JSON value, once whole, still does)
    min_tokens: int = 0
    include_stop: bool = False  # the text ends with the stop string found (vLLM's include_stop_str_in_output)
    # batch work (a line of a /v1/batches job): queued behind interactive requests, within a share
    # of the seats and pages, preempted first (``cluster.scheduler``)
    background: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt is empty")
        if self.handoff and self.prefilled is not None:
            raise ValueError("a request is either handed off (prefill) or prefilled (decode), not both")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.plan is not None and len(self.plan.unit_keys) != len(self.prompt_ids) // UNIT_TOKENS:
            raise ValueError(f"the prefix plan has {len(self.plan.unit_keys)} unit keys; the prompt has "
                             f"{len(self.prompt_ids) // UNIT_TOKENS} whole units")


@dataclass(slots=True)
class TokenSources:
    """Where each prompt token's KV came from, and why the computed tokens of whole units before
    the prompt's last token were not loaded instead: ``stale`` — the prefix plan loaded them (the
    directory listed a live holder) but the load did not deliver them (gone, damaged or late);
    ``declined`` — the directory listed holders but the plan did not load them (the router
    declined a load slower than computing); the rest of ``compute`` no live node was listed for
    (``evicted``: the first of them was dropped by the nodes that held it, by the directory's
    memory, so they count as evicted; else never seen). ``listed`` and ``planned``: the
    prompt tokens the fleet held by the directory's answer and those routing chose to load (a
    request without a prefix plan: 0)."""

    compute: int = 0
    ram: int = 0  # this replica's pool (shared pages) or the node's RAM tier
    ssd: int = 0
    remote: int = 0
    stale: int = 0  # of compute
    declined: int = 0  # of compute
    evicted: int = 0  # of compute
    listed: int = 0
    planned: int = 0

    @property
    def cached(self) -> int:
        return self.ram + self.ssd + self.remote

    def accounting(self, prompt_tokens: int) -> dict:
        """The prompt's cache accounting (``usage.prompt_cache_accounting``): of the tokens of
        its whole units before the last token (``cacheable_tokens``), those the directory listed
        live holders for, those routing chose to load, those delivered from a cache, and the
        rest by why they were computed (``unseen``: not listed, not remembered as dropped)."""
        cacheable = max(0, (prompt_tokens - 1) // UNIT_TOKENS * UNIT_TOKENS)  # the last token is always computed
        missed = max(0, cacheable - self.cached)
        return {"cacheable_tokens": cacheable, "listed_tokens": self.listed, "planned_tokens": self.planned,
                "delivered_tokens": self.cached,
                "missed_tokens": {"stale": self.stale, "declined": self.declined, "evicted": self.evicted,
                                  "unseen": max(0, missed - self.stale - self.declined - self.evicted)}}


@dataclass(frozen=True, slots=True)
class Prefilled:
    """A prompt prefilled elsewhere (P/D disaggregation): its latent KV ``kv`` [L, P, D] for the
    P prompt tokens, the first output token sampled from the prefill's logits, where the prompt's
    KV came from, and the sampler's generator state (seeded sampling continues where it was)."""

    kv: object  # torch.Tensor [L, P, D]
    first_token: int
    sources: TokenSources
    generator_state: object = None  # torch.ByteTensor or None
    first_logprob: TokenLogprob | None = None  # when the request asked for logprobs


class RequestOutput(NamedTuple):
    """What a step reports of one request: its new tokens and text since the last output and,
    when it finishes, why, with its usage and timings. A named tuple: immutable, and cheap to
    build once per running request per step."""

    request_id: str
    new_token_ids: list[int]
    text: str  # new text since the previous output
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    sources: TokenSources
    handoff: Prefilled | None = None  # with finish_reason HANDOFF
    decode_s: float = 0.0  # first to last output token, set when finished
    new_logprobs: list[TokenLogprob | None] | None = None  # one per new token, when the request asked
    queued_s: float = 0.0  # arrival to the first scheduled step, set when finished
    # with the first output, when the request asked (``SamplingParams.prompt_logprobs``): one per
    # prompt token, None for the first
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None  # with finish_reason ERROR
    background: bool = False  # set when finished: it was batch work (``GenerationRequest.background``)

    def then(self, later: RequestOutput) -> RequestOutput:
        """This output and the ``later`` one of the same request as one: their new tokens, text
        and logprobs in order, and the later one's state (counts, whether and why it finished)."""
        logprobs = None if self.new_logprobs is None and later.new_logprobs is None else \
            (self.new_logprobs or []) + (later.new_logprobs or [])
        return later._replace(new_token_ids=self.new_token_ids + later.new_token_ids, text=self.text + later.text,
                              new_logprobs=logprobs, prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs)


@dataclass(slots=True)
class Sequence:
    req: GenerationRequest
    unit_keys: list[bytes]  # chain keys of the prompt's whole units
    arrival_s: float = field(default_factory=time.monotonic)
    pages: list[int] = field(default_factory=list)
    # a page per page of ``pages`` for window rows, where the pool keeps them apart (V4): -1 where
    # none is held (out of the window, or not computed yet)
    window_pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # prompt (+ recomputed output) tokens whose KV is in the pool
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # one per output token
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token computed, when asked
    text: object = None  # cluster.output.TextStream: the output's text, decoded as tokens come
    emitted_tokens: int = 0
    load: object = None  # cache units being loaded while the request queues (a Future, or a LayeredLoad)
    feed: object = None  # cluster.layer_feed.LayerFeed: loaded units its first pass writes layer by layer
    expected_cached: int = 0  # prompt tokens the cache lookup found (the queue estimate)
    sources: TokenSources = field(default_factory=TokenSources)
    scheduled_s: float | None = None  # when a step first took it up (its queue time ends)
    first_token_s: float | None = None
    finished: FinishReason | None = None
    input_persisted: bool = False
    generator: object = None  # torch.Generator for seeded sampling
    # structured output: a Future while its grammar compiles, then its model.grammar.GrammarState
    grammar: object = None
    token_counts: object = None  # penalized requests: torch.Tensor [V], times each token was generated
    seen: object = None  # repetition-penalized requests: torch.Tensor [V], bool: in the prompt or output
    row: int | None = None  # its row of the engine's block tables while it runs (None: not running)
    drafts: list[int] = field(default_factory=list)  # the MTP layers' proposals for its next tokens

    @property
    def all_ids(self) -> list[int]:
        """Prompt and output ids (a copy: O(length); the step uses ``last_token`` and ``ids``)."""
        return list(self.req.prompt_ids) + self.output_ids

    def ids(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output, without copying the rest."""
        n = len(self.req.prompt_ids)
        if end <= n:
            return list(self.req.prompt_ids[start:end])
        return list(self.req.prompt_ids[start:n]) + self.output_ids[max(0, start - n) : end - n]

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.req.prompt_ids[-1]

    @property
    def length(self) -> int:
        return len(self.req.prompt_ids) + len(self.output_ids)
