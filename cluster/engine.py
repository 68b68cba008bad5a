"""The serving engine: continuous batching over a paged latent KV pool, with the prompt cache.

One engine drives one model replica. Each ``step`` does both of:

1. **Decode**: one token for every running sequence.
2. **Prefill** (chunked, at most ``max_prefill_tokens`` per step, or with ``itl_factor`` a chunk
   sized so the step keeps within that many decode steps' time, or ``itl_floor_ms``): the oldest
   waiting sequences are admitted when pages allow. A prompt's leading units come, in order of
   preference, from pages this replica already holds (prefix sharing), then from the prompt cache
   (this node's RAM or SSD, or with a cluster cache another node's agent), whose load started when
   the request arrived so it overlapped the queue wait. Only the rest is computed. A load that fails
   or times out is simply computed; it never yields wrong tokens.

The decode tokens ride in the first prefill chunk's forward pass (``model.mixed``), so running
sequences do not wait for a pass of their own behind a prompt's; with ``micro_batches=2`` the
chunk and the decode batch are that pass's two pipelined micro-batches (one's expert round hides
behind the other's attention). A decode pass of its own replays, on a CUDA model, the CUDA graph
of its batch bucket (``model.fixed_decode``) unless ``enforce_eager``; on a float32 CPU model it
is one C++ call (``model.cpu_step``). With the checkpoint's MTP layers loaded and drafting on
(``speculative_tokens``), a decode row verifies its drafts in the same pass and the MTP layers
propose the next ones (``cluster.speculative``): the tokens are those of decoding without.

Which sequences run and how much of each prompt is the scheduler's (``cluster.scheduler``); the
pages, the KV manager's (``cluster.kv_manager``); the output's text, ``cluster.output``'s;
structured output's grammars, ``cluster.constraints``'. When the pool is full, cached prefix entries are dropped first,
then the newest running sequence is preempted (its pages freed; it is recomputed later from its
tokens, which stay the same). New units are persisted per the admission policy after the input
and after the output, on the cache's I/O threads: persistence never blocks decode.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cachedir.admission import make_admission
from cachedir.hashing import RESUME_TOKEN, Namespace, chain_keys, resume_key
from cachedir.layered import LayeredLoad
from cachedir.node_cache import PromptCache
from cachedir.unit import Unit
from cluster.constraints import Constraints
from cluster.engine_config import EngineConfig
from cluster.kv_manager import long_tensor
from cluster.layer_feed import LayerFeed
from cluster.output import TextStream
from cluster.pass_timer import PassTimer
from cluster.request import (
    UNIT_TOKENS,
    FinishReason,
    GenerationRequest,
    PlanMismatch,
    Prefilled,
    RequestOutput,
    Sequence,
)
from cluster.scheduler import Scheduler, scored_chunk
from cluster.speculative import Speculator, VerifyRows
from cluster.window_kv import kv_manager
from model.fixed_decode import FixedShapeDecode, buckets_up_to
from model.grammar import GrammarVocab
from model.model import DeepseekModel
from model.moe import LocalExpertExecutor
from model.sampling import TokenLogprob, next_token_logprobs, sample, token_logprobs

__all__ = ["Engine", "EngineConfig"]

GPU_BACKGROUND_SLACK = 0.05  # EngineConfig.background_slack's default on a GPU

log = logging.getLogger(__name__)


class _Late:
    """A row whose token mask is still being filled: it is not sampled this step."""

    def __repr__(self) -> str:
        return "LATE"


LATE = _Late()


@dataclass(slots=True)
class _Pass:
    """What a prefill chunk's forward pass gave: the chunk's last logits [V] and its normed
    hidden states [T, M] (when the MTP layers run), and the decode rows that rode in it with
    their logits and hidden states."""

    logits: torch.Tensor | None
    hidden: torch.Tensor | None
    rows: VerifyRows | None
    decode_logits: torch.Tensor | None
    decode_hidden: torch.Tensor | None
    discarded: bool = False  # its prefix's load failed verification: the prompt is computed again


class Engine:
    def __init__(
        self,
        model: DeepseekModel,
        cfg: EngineConfig,
        namespace: Namespace,
        detokenize: Callable[[list[int]], str],
        eos_id: int | None,
        cache: PromptCache | None = None,
        grammar_vocab: Callable[[], GrammarVocab] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``grammar_vocab()``: the tokenizer's vocabulary as grammars read it, needed for
        structured output; ``clock``: seconds, for the speeds that size prefill chunks
        (``itl_factor``) of passes on the CPU (a GPU's are timed by its events)."""
        self.model = model
        self.cfg = cfg
        self.namespace = namespace
        self.detokenize = detokenize
        self.eos_id = eos_id
        self.cache = cache
        self.constraints = Constraints(grammar_vocab, model.cfg.vocab_size, eos_id)
        self.admission = make_admission(cfg.admission)
        self.kv = kv_manager(model, cfg.num_pages, cfg.page_size, cfg.max_num_seqs, UNIT_TOKENS, cfg.max_prefill_tokens,
                             cfg.speculative_tokens)
        self.layered_loads = not self.kv.resumable and (
            cfg.layered_loads if cfg.layered_loads is not None else model.device.type == "cuda")
        self.spec = Speculator(model, self.kv, cfg.speculative_tokens, cfg.speculative_max_batch)
        self.fixed_decode = self._fixed_decode(cfg.max_num_seqs)
        # a drafting step's verify pass and MTP pass, of fixed shapes too (up to k + 1 rows a sequence)
        rows = min(cfg.max_num_seqs, cfg.speculative_max_batch) * (self.spec.tokens + 1)
        self.fixed_verify = self._fixed_decode(rows, hidden=True) if self.spec.enabled else None
        if self.fixed_verify is not None:
            self.spec.fixed_draft = self._fixed_decode(rows, draft_layer=0)
        self.idle = False  # the last step found nothing it could do yet
        # finished_*: requests finished, their prompt tokens and those found cached (a replica's hit rate)
        self.stats = {"preemptions": 0, "load_failures": 0, "prefill_tokens": 0, "decode_tokens": 0, "mixed_steps": 0,
                      "masks_late": 0, "finished": 0, "finished_prompt_tokens": 0, "finished_cached_tokens": 0,
                      "finished_local_tokens": 0}
        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.max_prefill_tokens, cfg.itl_factor, self._admit,
                                   self._admit_prefilled, self.stats, itl_floor_s=cfg.itl_floor_ms / 1e3,
                                   ready=self.constraints.ready, background_share=cfg.background_share,
                                   background_slack=cfg.background_slack if cfg.background_slack is not None
                                   else GPU_BACKGROUND_SLACK if model.device.type == "cuda" else 0.0,
                                   scored_chunk=scored_chunk(cfg.scored_logits_mib, model.cfg.vocab_size))
        self._by_id: dict[str, Sequence] = {}
        self._lock = threading.RLock()  # add/abort from other threads vs step
        self._aborted = False  # an abort arrived since the last step
        self.timer = PassTimer(model.device, clock)  # on a GPU, device time read a pass later
        if cfg.pace is not None and model.device.type == "cuda":
            raise ValueError("EngineConfig.pace emulates a device on the CPU; this model computes on a GPU")

    @property
    def waiting(self) -> deque[Sequence]:
        """Sequences waiting for (the rest of) their prefill, oldest first (``scheduler``'s)."""
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        """Sequences that decode (``scheduler``'s)."""
        return self.scheduler.running

    @property
    def prefill_samples(self) -> deque[tuple[int, int, float]]:
        """(new, cached, seconds) of the latest prefill passes (``scheduler``'s)."""
        return self.scheduler.prefill_samples

    # -- requests ------------------------------------------------------------------------
    def namespace_for(self, tenant: str) -> Namespace:
        return self.namespace.for_tenant(tenant) if tenant else self.namespace

    def add_request(self, req: GenerationRequest) -> None:
        """Queue a request; its cached units start loading now (overlapping the queue wait)."""
        max_ctx = self.model.cfg.max_position_embeddings
        if len(req.prompt_ids) + req.max_tokens > max_ctx:
            raise ValueError(
                f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the "
                f"context length {max_ctx}"
            )
        need = self.kv.pages_for(len(req.prompt_ids) + req.max_tokens)
        if need > self.cfg.num_pages:
            raise ValueError(f"request needs {need} KV pages, the pool has {self.cfg.num_pages}")
        ns = self.namespace_for(req.tenant)
        plan = req.plan  # the ingress hashed the prompt once: its keys are the prompt's keys
        if plan is not None and plan.namespace != ns.id:
            raise PlanMismatch(f"the request's prefix plan was made in cache namespace {plan.namespace!r}, this "
                               f"replica's is {ns.id!r}: the ingress and the replicas disagree on the model, its "
                               f"dtype, its weights' form or the cache secret")
        keys = list(plan.unit_keys) if plan is not None else chain_keys(ns.seed, req.prompt_ids, UNIT_TOKENS)
        text = TextStream(self.detokenize, req.stop, req.continued_ids, req.continued_chars, req.include_stop)
        seq = Sequence(req, keys, text=text)
        # Penalties read per-token counts kept on the logits' device, in their dtype, and counted
        # there as tokens come: a step moves no [V] row to the device and the cost does not grow
        # with the output.
        vocab, device = self.model.cfg.vocab_size, self.model.device
        if req.sampling.penalized:
            seq.token_counts = torch.bincount(long_tensor(list(req.continued_ids)), minlength=vocab)[:vocab].to(
                device, torch.float32)
        if req.sampling.repeats:  # the prompt's tokens once; the output's as they come
            seen = torch.zeros(vocab, dtype=torch.bool)
            seen[long_tensor([t for t in req.prompt_ids if t < vocab])] = True
            seq.seen = seen.to(device)
        if req.sampling.seed is not None:
            seq.generator = torch.Generator().manual_seed(req.sampling.seed)
        if req.grammar is not None:
            self.constraints.start(seq)
        scored = req.sampling.prompt_logprobs is not None and req.prefilled is None
        if scored:  # every prompt position's logits are needed: computed whole, nothing loaded
            seq.prompt_logprobs = [None]
        if req.prefilled is not None:
            self._check_prefilled(req)
            if seq.generator is not None and req.prefilled.generator_state is not None:
                seq.generator.set_state(req.prefilled.generator_state)
        usable = len(req.prompt_ids) // UNIT_TOKENS if req.prefilled is None and not scored else 0
        if plan is not None:  # load what the plan says (the router may have declined a slow load)
            usable = min(usable, plan.loadable)
        if self.cache is not None and usable:
            tiers = self.cache.lookup(keys[:usable], plan.holders[:usable], dict(plan.addresses)) if plan is not None \
                else self.cache.lookup(keys[:usable])
            n = self._resumable(ns, keys, len(tiers)) if self.kv.resumable else len(tiers)
            if n:
                toks = [req.prompt_ids[i * UNIT_TOKENS : (i + 1) * UNIT_TOKENS] for i in range(n)]
                load = list(keys[:n])
                if self.kv.resumable:  # the units' entries, then the window state after the last
                    load.append(resume_key(ns.seed, keys[n - 1]))
                    toks.append((RESUME_TOKEN,))
                layered = getattr(self.cache, "load_layered", None) if self.layered_loads else None
                seq.load = (layered or self.cache.load_async)(load, ns.seed, toks)
                seq.expected_cached = n * UNIT_TOKENS
        with self._lock:
            if req.request_id in self._by_id:
                raise ValueError(f"duplicate request id {req.request_id!r}")
            self._by_id[req.request_id] = seq
            self.scheduler.add(seq)

    def _resumable(self, ns: Namespace, keys: list[bytes], n: int) -> int:
        """The longest of the first ``n`` units after which the cache holds a resume record (a
        model whose KV is more than its units': only there can a loaded prefix go on)."""
        for m in range(n, 0, -1):
            if self.cache.lookup([resume_key(ns.seed, keys[m - 1])]):
                return m
        return 0

    def _check_prefilled(self, req: GenerationRequest) -> None:
        kv = req.prefilled.kv
        want = self.kv.pool.handoff_shape(len(req.prompt_ids))
        if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != want:
            got = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
            raise ValueError(f"prefilled KV has shape {got}, this model needs {want}")

    def abort(self, request_id: str) -> None:
        with self._lock:
            seq = self._by_id.get(request_id)
            if seq is not None and seq.finished is None:
                seq.finished = FinishReason.ABORT
                self._aborted = True

    def queue_state(self, limit: int = 256) -> list[tuple[int, int]]:
        """(new, cached) prompt tokens of the waiting requests, oldest first (prefill LB input)."""
        return self.scheduler.queue_state(limit)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def background_only(self) -> bool:
        """Whether every request it holds is background work (batch lines)."""
        return all(seq.req.background for seq in (*self.scheduler.running, *self.scheduler.waiting))

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """A token for every running sequence and the next chunks of the waiting prompts: a
        forward pass per chunk, the decode riding in the first (a pass of its own when nothing is
        prefilled)."""
        outputs: list[RequestOutput] = []
        with self._lock:
            self._reap_aborted(outputs)
        batch = self.scheduler.decode_batch()
        spec = self.spec.active(batch)  # the batch verifies drafts (the MTP layers propose more)
        chunks = self.scheduler.prefill_chunks(batch)
        self.constraints.prefetch(batch)  # the batch's token masks, filled while its pass runs
        self.idle = not batch and not chunks  # work waits (a grammar compiling): the loop may rest
        rode = None
        for k, (seq, end) in enumerate(chunks):
            # the decode rides in the first (not a scored one, nor one whose prefix is still loading)
            rides = k == 0 and seq.prompt_logprobs is None and seq.feed is None
            done = self._run_chunk(seq, end, batch if rides else None, spec)
            rode = done if done.rows is not None else rode
            self._chunk_done(seq, end, done, outputs)
        if batch:
            self._decode(batch, rode, spec, outputs)
        return outputs

    def _paced(self, tokens: int, rows: int) -> float:
        """The least a pass of ``tokens`` prompt tokens and ``rows`` decode rows lasts (``pace``)."""
        return self.cfg.pace.seconds(tokens, rows) if self.cfg.pace is not None else 0.0

    def _reap_aborted(self, outputs: list[RequestOutput]) -> None:
        if not self._aborted:
            return
        self._aborted = False
        for seq in [s for s in list(self.waiting) + self.running if s.finished == FinishReason.ABORT]:
            self.scheduler.remove(seq)
            self._finish(seq, FinishReason.ABORT, outputs)

    def _run_chunk(self, seq: Sequence, end: int, batch: list[Sequence] | None, spec: bool) -> _Pass:
        """Compute ``seq``'s prompt up to ``end``, with ``batch``'s decode rows in the same
        forward pass when given (verifying their drafts when ``spec``); the MTP layers, when
        they run, read the chunk's positions whose next token is known."""
        start, n_new = seq.num_computed, end - seq.num_computed
        self.kv.prepare(seq, end)
        ids, table = long_tensor(seq.ids(start, end)), self.kv.table(seq)
        drafting = {"hidden": True} if self.spec.enabled else {}  # the MTP layers read the hidden states
        done = _Pass(None, None, None, None, None)
        feed, seq.feed = seq.feed, None
        waited = (lambda: feed.waited_s) if feed is not None else (lambda: 0.0)  # not the chunk's cost
        riding = len(batch) if batch else 0  # decode rows in the pass
        with self.timer.timed(lambda s: self.scheduler.observe_chunk(n_new, start, s - waited(), riding),
                              self._paced(n_new, riding)):
            if batch:
                done.rows = rows = self._decode_rows(batch, spec)
                out = self.model.mixed(ids, table, start, rows.tokens, rows.tables, rows.positions, self.kv.pool,
                                       micro_batches=self.cfg.micro_batches, **drafting)
                done.logits, done.decode_logits = out[:2]
                if drafting:
                    done.hidden, done.decode_hidden = out[2:]
                self.stats["mixed_steps"] += 1
            elif seq.prompt_logprobs is not None:
                every = self.model.prefill(ids, self.kv.pool, table, start=start, all_logits=True, **drafting)
                every, done.hidden = every if drafting else (every, None)  # [T, V]
                self._score_prompt(seq, start, end, every)
                done.logits = every[-1]
            else:
                fed = {"before_layer": feed} if feed is not None else {}  # (only DeepseekModel's pools load so)
                out = self.model.prefill(ids, self.kv.pool, table, start=start, **fed, **drafting)
                done.logits, done.hidden = out if drafting else (out, None)
            if feed is not None and not feed.finish():
                self._unload(seq, feed.first)
                done.discarded = True
                return done
            if done.hidden is not None:
                self._draft_prompt(seq, start, end, done.hidden, table)
        self.stats["prefill_tokens"] += n_new
        seq.num_computed = end
        self.kv.trim(seq)
        return done

    def _draft_prompt(self, seq: Sequence, start: int, end: int, hidden: torch.Tensor, table: torch.Tensor) -> None:
        """The MTP layers over a chunk's positions whose next token is known (a final chunk's
        last waits for the first output token: ``Speculator.propose_one``)."""
        n = end - start - (end >= seq.length)
        if n > 0:
            self.model.draft_chunk(0, hidden[:n], long_tensor(seq.ids(start + 1, start + n + 1)), self.kv.pool, table,
                                   start)

    @staticmethod
    def _score_prompt(seq: Sequence, start: int, end: int, logits: torch.Tensor) -> None:
        """Record the logprobs of the prompt tokens after positions ``start..end-1`` (row r of
        ``logits`` predicts token start + r + 1) not recorded before (a recompute after preemption
        records nothing twice)."""
        prompt = seq.req.prompt_ids
        first, stop = max(start + 1, len(seq.prompt_logprobs)), min(end + 1, len(prompt))
        if first < stop:
            seq.prompt_logprobs += next_token_logprobs(logits[first - start - 1 :], list(prompt[first:stop]),
                                                       seq.req.sampling.prompt_logprobs)

    def _chunk_done(self, seq: Sequence, end: int, done: _Pass, outputs: list[RequestOutput]) -> None:
        """After a chunk: a finished prompt joins the running sequences with its first token (and
        its first drafts)."""
        if end < seq.length or done.discarded:
            return
        logits = done.logits
        self.scheduler.prefilled(seq)
        if self.cfg.prefix_sharing and self.kv.share_at_input and seq.prompt_logprobs is None:
            self.kv.share(seq.unit_keys[: seq.num_computed // UNIT_TOKENS], seq)
        if not seq.input_persisted:
            seq.input_persisted = True
            self._persist(seq, self.admission.on_input_end(seq.unit_keys).units, seq.unit_keys)
        tok = self._choose(logits[None], [seq])[0]
        if isinstance(tok, Exception):
            self._fail(seq, tok, outputs)
            return
        self._append(seq, tok, outputs, token_logprobs(logits[None], [tok], [seq.req.sampling])[0])
        if done.hidden is not None and seq.finished is None and self.spec.active([seq]):
            self.spec.propose_one(seq, done.hidden[-1])

    def _unload(self, seq: Sequence, first: int) -> None:
        """``seq``'s loaded units (from unit ``first``) failed verification after its pass used
        them: that pass is thrown away and the prompt is computed from there (a miss)."""
        self.stats["load_failures"] += 1
        seq.num_computed = first * UNIT_TOKENS
        src = seq.sources
        src.ram, src.ssd, src.remote = min(src.ram, seq.num_computed), 0, 0
        src.compute = len(seq.req.prompt_ids) - src.cached

    def _admit(self, seq: Sequence) -> bool:
        """Give ``seq`` pages for its tokens, reusing or loading its cached leading units."""
        # Shared pages are immutable, so they never include the prompt's last token, which is
        # always computed (its logits start the output). A loaded unit may: that token's KV is
        # then recomputed into the sequence's own page.
        usable = len(seq.req.prompt_ids) // UNIT_TOKENS
        shareable = (len(seq.req.prompt_ids) - 1) // UNIT_TOKENS if self.cfg.prefix_sharing else 0
        if seq.prompt_logprobs is not None:  # scored: every position computed
            shareable = 0
        shared = self.kv.match(seq.unit_keys[:shareable])
        loaded: list = []
        seq.feed = None  # (a feed from an admission before a preemption wrote pages no longer its own)
        layered = isinstance(seq.load, LayeredLoad)
        if seq.load is not None and len(shared) < usable:
            try:  # a layered load says now which units it brings; their KV comes during the first pass
                results = seq.load.units(self.cfg.load_timeout_s) if layered else \
                    seq.load.result(timeout=self.cfg.load_timeout_s)
            except Exception:  # noqa: BLE001 - any load failure is a cache miss, never an error
                self.stats["load_failures"] += 1
                results = []
            resume = results.pop() if self.kv.resumable and results else None
            for r in results[len(shared) :]:
                if r is None or not self.kv.fits(r.unit):
                    break
                loaded.append(r)
            if loaded and self.kv.resumable and (len(shared) + len(loaded) < len(results) or resume is None
                                                 or not self.kv.fits_resume(resume.unit)):
                loaded = []  # entries without the state to go on after them: computed instead
            if not layered:
                seq.load = None
        n_cached_units = len(shared) + len(loaded)
        if not self.kv.admit(seq, shared, seq.length + 1):
            return False
        if layered and loaded:
            seq.feed = LayerFeed(seq.load, self.kv, seq, len(shared), [r.unit for r in loaded],
                                 self.cfg.load_timeout_s)
        seq.load = None
        for i, r in enumerate(loaded if seq.feed is None else ()):
            self.kv.write_unit(seq, len(shared) + i, r.unit)
        if loaded and self.kv.resumable:
            self.kv.write_resume(seq, n_cached_units * UNIT_TOKENS, resume.unit, len(shared) * UNIT_TOKENS)
        seq.num_computed = min(n_cached_units * UNIT_TOKENS, seq.length - 1)
        if not seq.input_persisted:  # first admission (not a recompute after preemption)
            src = seq.sources
            src.ram = (len(shared) + sum(r.tier == "ram" for r in loaded)) * UNIT_TOKENS
            src.ssd = sum(r.tier == "ssd" for r in loaded) * UNIT_TOKENS
            src.remote = sum(r.tier == "remote" for r in loaded) * UNIT_TOKENS
            if src.cached > seq.num_computed:  # the recomputed last token (of the last unit)
                last = loaded[-1].tier if loaded else "ram"
                setattr(src, last, getattr(src, last) - 1)
            src.compute = len(seq.req.prompt_ids) - src.cached
            plan = seq.req.plan
            if plan is not None:  # why the units past the cached ones were computed
                units = (len(seq.req.prompt_ids) - 1) // UNIT_TOKENS  # the last token is always computed
                held, planned = min(len(plan.holders), units), min(plan.loadable, units)
                src.stale = max(0, planned - n_cached_units) * UNIT_TOKENS
                src.declined = max(0, held - max(planned, n_cached_units)) * UNIT_TOKENS
                src.listed, src.planned = held * UNIT_TOKENS, planned * UNIT_TOKENS
                if plan.dropped_next:  # the units past those listed: evicted, not never seen
                    src.evicted = max(0, units - max(held, n_cached_units)) * UNIT_TOKENS
        return True

    def _admit_prefilled(self, seq: Sequence) -> bool:
        """Pages for a sequence prefilled on another replica; its prompt KV is written in and its
        first token (sampled there) becomes the input of the next decode step."""
        pre = seq.req.prefilled
        n = len(seq.req.prompt_ids)
        if not self.kv.admit(seq, [], n + 1):
            return False
        self.kv.import_prompt(seq, pre.kv)
        seq.num_computed = n
        seq.output_ids.append(pre.first_token)
        seq.output_logprobs.append(pre.first_logprob)
        if seq.token_counts is not None:
            seq.token_counts[pre.first_token] += 1
        if seq.seen is not None:
            seq.seen[pre.first_token] = True
        seq.text.feed(pre.first_token)  # this replica streams it (the prefill replica's output was not sent)
        self.constraints.feed(seq, pre.first_token)
        seq.sources = dataclasses.replace(pre.sources)
        seq.input_persisted = True  # the prefill replica persisted the prompt
        seq.first_token_s = time.monotonic()
        return True

    def _fixed_decode(self, rows: int, **kind) -> FixedShapeDecode | None:
        """CUDA graphs of the decode step (or ``kind``: a verify or MTP step), one per bucket of
        up to ``rows`` rows, where they can replay it: a CUDA model with a paged attention
        kernel, its experts in this process, one micro-batch."""
        m = self.model
        if self.cfg.enforce_eager or not isinstance(m, DeepseekModel) or m.device.type != "cuda" \
                or self.cfg.micro_batches != 1 \
                or m.paged_kernel is None \
                or not all(isinstance(moe.executor, LocalExpertExecutor) for moe in m.moe_layers()):
            return None
        return FixedShapeDecode(m, self.kv.pool, self.kv.scratch_page, self.kv.max_pages, buckets_up_to(rows),
                                capture=True, **kind)

    def _decode_rows(self, batch: list[Sequence], spec: bool) -> VerifyRows:
        """A decode pass's rows: block tables [R, W] (gathered rows), tokens [R], positions [R];
        with ``spec`` each sequence's drafts follow its last token."""
        if spec:
            return self.spec.rows(batch)
        # a running sequence has an output token, and its KV up to the one before (num_computed)
        return VerifyRows(self.kv.tables(batch), long_tensor([s.output_ids[-1] for s in batch]),
                          long_tensor([s.num_computed for s in batch]), list(range(len(batch))))

    def _decode(self, batch: list[Sequence], rode: _Pass | None, spec: bool, outputs: list[RequestOutput]) -> None:
        """The next tokens of every sequence of ``batch`` (one, and the drafts accepted), from the
        logits of the prefill chunk's pass its decode rode in, else of a decode pass of its own."""
        guessed = None
        if rode is not None:
            rows, logits, hidden = rode.rows, rode.decode_logits, rode.decode_hidden
        else:
            rows, hidden = self._decode_rows(batch, spec), None
            with self.timer.timed(lambda s: self.scheduler.observe_decode(s, len(batch)), self._paced(0, len(batch))):
                if self.fixed_decode is not None and not spec:
                    logits = self.fixed_decode(rows.tokens, rows.tables, rows.positions)
                elif self.fixed_verify is not None and spec:
                    logits, hidden = self.fixed_verify(rows.tokens, rows.tables, rows.positions)
                elif spec:
                    logits, hidden, guessed = self.spec.verify(rows, self.cfg.micro_batches)
                else:
                    logits = self.model.decode(rows.tokens, self.kv.pool, rows.tables, rows.positions,
                                               micro_batches=self.cfg.micro_batches)
        argmax = guessed.tokens if guessed is not None and self._plain_greedy(batch) else None
        taken = self._sample_rows(batch, logits, rows.first, outputs, argmax)
        self.stats["decode_tokens"] += sum(taken)
        if spec:
            going = [b for b, seq in enumerate(batch) if seq.finished is None and taken[b]]
            self.spec.propose([batch[b] for b in going], hidden,
                              [list(range(rows.first[b], rows.first[b] + taken[b])) for b in going], guessed)

    def _plain_greedy(self, batch: list[Sequence]) -> bool:
        """Whether every row's token is its logits' argmax: greedy with no bias or penalty, no
        grammar, no logprobs, and no EOS held back for ``min_tokens``."""
        return all(s.req.sampling.plain_greedy and s.req.sampling.logprobs is None and s.grammar is None
                   and self._produced(s) + 1 >= s.req.min_tokens for s in batch)

    def _sample_rows(self, batch: list[Sequence], logits: torch.Tensor, first: list[int],
                     outputs: list[RequestOutput], argmax: list[int] | None = None) -> list[int]:
        """Each sequence's next token from its first row of ``logits``, then, while the token
        sampled equals the draft the next row verifies, the next one from that row: decoding a
        token at a time, with the pass's logits. ``argmax``: each row's argmax, where that is
        its token (``_plain_greedy``). Returns how many tokens each took."""
        taken, live, j = [0] * len(batch), list(range(len(batch))), 0
        while live:
            seqs = [batch[b] for b in live]
            if argmax is not None:
                toks: list = [argmax[first[b] + j] for b in live]
                rows = None
            else:
                rows = logits if j == 0 and len(live) == logits.shape[0] else \
                    logits[long_tensor([first[b] + j for b in live])]
                # one sampling call per round: on a GPU, one copy of the tokens to the host; the
                # first round waits a bounded time for the masks filled while the pass ran (later
                # rounds' states were just fed: their masks are filled here)
                toks = self._choose(rows, seqs, self.cfg.mask_wait_ms / 1000 if j == 0 else None)
            chosen = [t if isinstance(t, int) else 0 for t in toks]
            going = []
            lps = token_logprobs(rows, chosen, [s.req.sampling for s in seqs]) if rows is not None else \
                [None] * len(seqs)
            for b, seq, tok, lp in zip(live, seqs, toks, lps, strict=True):
                if tok is LATE:  # decodes this position again next step (its KV is rewritten the same)
                    continue
                seq.num_computed = seq.length
                if isinstance(tok, Exception):
                    self._fail(seq, tok, outputs)
                    continue
                drafted = j < len(seq.drafts)
                if drafted and tok == seq.drafts[j]:
                    self.spec.accepted(j)
                self._append(seq, tok, outputs, lp, emit=False)
                taken[b] += 1
                if drafted and tok == seq.drafts[j] and seq.finished is None:
                    going.append(b)
            live, j = going, j + 1
        for b, seq in enumerate(batch):
            if taken[b] and seq.finished is None:
                outputs.append(self._output(seq))
        return taken

    def _choose(self, logits: torch.Tensor, batch: list[Sequence], mask_wait_s: float | None = None) -> list:
        """The next token of each row of ``logits`` [B, V] under its request's constraints and
        sampling, in one call (on a GPU, one copy of the tokens to the host); where that raises,
        row by row, so that a row whose grammar or sampling fails gets its error and the others
        their tokens. A row whose mask is still being filled after ``mask_wait_s`` is ``LATE``
        (not sampled: its random draws are not spent)."""
        try:
            allowed, late = self.constraints.apply(self._hold_stops(logits, batch), batch, mask_wait_s)
            if late:
                self.stats["masks_late"] += len(late)
                keep = [b for b in range(len(batch)) if b not in late]
                toks: list = [LATE] * len(batch)
                for b, tok in zip(keep, self._sample([batch[b] for b in keep], allowed[long_tensor(keep)]), strict=True):
                    toks[b] = tok
                return toks
            return self._sample(batch, allowed)
        except Exception as e:  # noqa: BLE001 - contained to the rows that raise it
            if len(batch) == 1:
                log.warning("request %s failed to sample: %r", batch[0].req.request_id, e)
                return [e]
            return [self._choose(logits[b : b + 1], [seq], mask_wait_s)[0] for b, seq in enumerate(batch)]

    @staticmethod
    def _sample(batch: list[Sequence], allowed: torch.Tensor) -> list[int]:
        if not batch:
            return []
        return sample(allowed, [s.req.sampling for s in batch], [s.generator for s in batch],
                      [s.token_counts for s in batch], [s.seen for s in batch]).tolist()

    def _fail(self, seq: Sequence, error: Exception, outputs: list[RequestOutput]) -> None:
        """``seq`` fails alone (it decodes no more; its pages go)."""
        self.scheduler.leave_running(seq)
        self._finish(seq, FinishReason.ERROR, outputs, error=f"{type(error).__name__}: {error}")

    # -- tokens out ----------------------------------------------------------------------
    def _append(self, seq: Sequence, tok: int, outputs: list[RequestOutput], lp: TokenLogprob | None = None,
                emit: bool = True) -> None:
        """``tok`` is ``seq``'s next; it finishes it, or (``emit``) goes out as an output."""
        if seq.first_token_s is None:
            seq.first_token_s = time.monotonic()
        seq.output_ids.append(tok)
        seq.output_logprobs.append(lp)
        if seq.token_counts is not None:
            seq.token_counts[tok] += 1
        if seq.seen is not None:
            seq.seen[tok] = True
        req, constrained = seq.req, seq.grammar is not None
        if constrained:
            try:
                self.constraints.feed(seq, tok)
            except ValueError as e:  # a token the grammar refuses: this request fails, not the batch
                self._fail(seq, e, outputs)
                return
        may_stop = self._produced(seq) >= req.min_tokens
        eos = may_stop and ((tok == self.eos_id and not req.ignore_eos) or tok in req.stop_token_ids)
        reason = None
        if eos or (constrained and self.constraints.done(seq)):
            reason = FinishReason.STOP
        elif len(seq.output_ids) >= req.max_tokens:
            reason = FinishReason.LENGTH
        if reason is None and req.handoff:
            reason = FinishReason.HANDOFF
        if not eos and seq.text.feed(tok, stops=may_stop):  # the EOS (or stop) token has no text
            reason = FinishReason.STOP  # a stop string: the text ends before it
        if reason is not None:
            self.scheduler.leave_running(seq)
            self._finish(seq, reason, outputs)
        elif emit:
            outputs.append(self._output(seq))

    @staticmethod
    def _produced(seq: Sequence) -> int:
        """Output tokens so far, those another replica generated (a continued request) included."""
        return len(seq.req.continued_ids) + len(seq.output_ids)

    def _hold_stops(self, logits: torch.Tensor, batch: list[Sequence]) -> torch.Tensor:
        """``logits`` [B, V] with EOS and the stop tokens at -inf in the rows whose next token is
        before their ``min_tokens`` (a copy when any is; rows under JSON masks keep theirs)."""
        rows = [b for b, s in enumerate(batch) if self._produced(s) + 1 < s.req.min_tokens
                and not self.constraints.holds(s)]
        if not rows:
            return logits
        logits = logits.clone()
        for b in rows:
            req = batch[b].req
            held = list(req.stop_token_ids)
            if self.eos_id is not None and not req.ignore_eos:
                held.append(self.eos_id)
            logits[b, [t for t in held if t < logits.shape[-1]]] = float("-inf")
        return logits

    def _output(self, seq: Sequence, handoff: Prefilled | None = None, error: str | None = None) -> RequestOutput:
        """New tokens and text since the last output (``cluster.output.TextStream`` holds back
        text that may start a stop string or end inside a character until it finishes)."""
        text = seq.text.take(seq.finished is not None)
        new = seq.output_ids[seq.emitted_tokens :]
        logprobs = seq.output_logprobs[seq.emitted_tokens :] if seq.req.sampling.logprobs is not None else None
        scored = seq.prompt_logprobs if seq.emitted_tokens == 0 and new else None  # with the first tokens
        seq.emitted_tokens = len(seq.output_ids)
        return RequestOutput(
            seq.req.request_id, new, text, seq.finished is not None, seq.finished,
            len(seq.req.prompt_ids), len(seq.output_ids), seq.sources.cached, seq.sources, handoff,
            time.monotonic() - seq.first_token_s if seq.finished and seq.first_token_s is not None else 0.0,
            logprobs,
            seq.scheduled_s - seq.arrival_s if seq.finished and seq.scheduled_s is not None else 0.0,
            scored, error, seq.finished is not None and seq.req.background,
        )

    def _finish(self, seq: Sequence, reason: FinishReason, outputs: list[RequestOutput], error: str | None = None
                ) -> None:
        seq.finished = reason
        handoff = None
        if reason == FinishReason.HANDOFF:
            state = seq.generator.get_state() if seq.generator is not None else None
            handoff = Prefilled(self.kv.export_prompt(seq), seq.output_ids[0], dataclasses.replace(seq.sources), state,
                                seq.output_logprobs[0])
        if seq.pages:
            ns = self.namespace_for(seq.req.tenant)
            complete = seq.num_computed // UNIT_TOKENS
            known = min(complete, len(seq.unit_keys))  # the prompt's, hashed once; the chain goes on
            all_keys = seq.unit_keys[:known] + chain_keys(
                ns.seed, seq.ids(known * UNIT_TOKENS, complete * UNIT_TOKENS), UNIT_TOKENS,
                parent=seq.unit_keys[known - 1] if known else None)
            if self.cfg.prefix_sharing:
                self.kv.share(all_keys, seq)
            if reason not in (FinishReason.ABORT, FinishReason.ERROR):
                admit = self.admission.on_output_end(all_keys, len(seq.unit_keys))
                self._persist(seq, admit.units, all_keys)
            self.kv.release(seq)
        with self._lock:
            self._by_id.pop(seq.req.request_id, None)
        self.stats["finished"] += 1
        self.stats["finished_prompt_tokens"] += len(seq.req.prompt_ids)
        self.stats["finished_cached_tokens"] += seq.sources.cached
        self.stats["finished_local_tokens"] += seq.sources.ram + seq.sources.ssd  # of those, this node's own
        outputs.append(self._output(seq, handoff=handoff, error=error))

    def _persist(self, seq: Sequence, unit_idx: list[int], keys: list[bytes]) -> None:
        if self.cache is None or not unit_idx:
            return
        ns = self.namespace_for(seq.req.tenant)
        units = []
        for i in unit_idx:
            if (i + 1) * UNIT_TOKENS > seq.num_computed or self.cache.holds(keys[i]):
                continue
            data = self.kv.read_unit(seq, i)  # [L, 64, D]
            payload = data.view(torch.uint8).numpy().tobytes()
            parent = keys[i - 1] if i else ns.seed
            units.append(Unit(ns.seed, keys[i], parent, tuple(seq.ids(i * UNIT_TOKENS, (i + 1) * UNIT_TOKENS)),
                              payload, data.shape[0], data.shape[2], str(data.dtype).removeprefix("torch.")))
        done = [i for i in unit_idx if (i + 1) * UNIT_TOKENS <= seq.num_computed]
        if self.kv.resumable and done:  # where this persist ends, a later prompt may go on
            last = max(done)
            key = resume_key(ns.seed, keys[last])
            if not self.cache.holds(key):
                data = self.kv.read_resume(seq, (last + 1) * UNIT_TOKENS)
                units.append(Unit(ns.seed, key, keys[last], (RESUME_TOKEN,), data.view(torch.uint8).numpy().tobytes(),
                                  1, data.shape[2], str(data.dtype).removeprefix("torch.")))
        self.cache.persist(units)

    # -- convenience ---------------------------------------------------------------------
    def run_to_completion(self) -> dict[str, list[RequestOutput]]:
        """Step until idle; every output, grouped by request (tests, the CLI, benchmarks)."""
        out: dict[str, list[RequestOutput]] = {}
        while self.has_work():
            for o in self.step():
                out.setdefault(o.request_id, []).append(o)
            if self.idle:
                self.constraints.wait_compiled(timeout=1.0)
        return out

    def check_integrity(self) -> None:
        """Every page's refcount equals its holders (sequences, prefix entries): no leak, no
        double free; every running sequence holds the KV of all its tokens but the last; every
        request is running, waiting or reported finished."""
        self.kv.check_integrity(list(self.waiting) + self.running, self.running)
        for seq in self.running:  # a decode step's position is num_computed: the KV of all but the last token
            assert seq.output_ids and seq.num_computed == seq.length - 1, (seq.req.request_id, seq.num_computed, seq.length)
        live = {s.req.request_id for s in list(self.waiting) + self.running}
        assert live == set(self._by_id), (live, set(self._by_id))
