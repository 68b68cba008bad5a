"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds; the log-probabilities
of the chosen tokens and their top alternatives (OpenAI's ``logprobs``).

Legend: B sequences, V vocab.
"""

from __future__ import annotations

import torch

from kernels.cpu_gemv import argmax_rows, sample_rows
from model.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams, TokenLogprob

__all__ = ["MAX_LOGIT_BIAS", "MAX_LOGPROBS", "NUCLEUS_CANDIDATES", "SamplingParams", "TokenLogprob", "biased", "next_token_logprobs",
           "penalized", "sample", "token_logprobs"]

NUCLEUS_CANDIDATES = 1024  # top-p looks here first: sorting a 129k vocabulary costs ~5 ms a row


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
    outputs: list[list[int] | torch.Tensor | None] | None = None,
    seen: list[list[int] | torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """logits [B, V] fp32 (any device) -> token ids [B] on the CPU (one copy to the host).
    ``generators[b]`` (a CPU generator) makes row b reproducible, whatever rows share its batch;
    ``outputs[b]``: the tokens row b generated so far, as ids or as counts per token [V] (the
    presence and frequency penalties count them); ``seen[b]``: the tokens of its prompt and
    output, as ids or as a mask [V] (the repetition penalty). Each row's ``logit_bias`` is added
    first, then the penalties apply.

    The sampled rows are processed together on the logits' device: temperature, top-k, top-p and
    min-p as batched tensor ops (top-p and min-p sort only the ``NUCLEUS_CANDIDATES`` most likely
    tokens when they hold what is kept, else the whole vocabulary), then one inverse-CDF draw per
    row; fp32 CPU logits take the C++ kernel with the same contract (``kernels.cpu_gemv.sample_rows``,
    rows without min-p), each row's uniform drawn the same way."""
    if all(p.plain_greedy for p in params):  # the common case: one argmax, nothing else
        return _argmax(logits).cpu()
    if any(p.logit_bias for p in params):
        logits = biased(logits, params)
    if any(p.penalized or p.repeats for p in params):
        logits = penalized(logits, params, outputs, seen)
    rows = [b for b, p in enumerate(params) if not p.greedy]
    if len(rows) == len(params):  # every row samples: no argmax, no copy of the rows
        return _sample_rows(logits, params, generators).cpu()
    out = _argmax(logits)  # [B]
    if rows:
        out[rows] = _sample_rows(logits[rows], [params[b] for b in rows], [generators[b] for b in rows])
    return out.cpu()


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B]: the greedy choices (a vectorized kernel for fp32 CPU logits)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1]:
        return argmax_rows(logits.contiguous())
    return logits.argmax(dim=-1)


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits [R, V] of rows that sample -> their tokens [R] (on the logits' device)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 \
            and not any(p.min_p for p in params):
        vocab = logits.shape[-1]
        out = sample_rows(logits, torch.tensor([p.temperature for p in params]),
                          torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params]),
                          torch.tensor([p.top_p for p in params]), _uniforms(len(params), generators, logits.device))
        if out is not None:
            return out
    return _sample_rows_torch(logits, params, generators)


def _sample_rows_torch(logits: torch.Tensor, params: list[SamplingParams],
                       generators: list[torch.Generator | None]) -> torch.Tensor:
    """``_sample_rows`` in batched torch ops (any device; the C++ kernel's reference)."""
    dev, vocab = logits.device, logits.shape[-1]
    temp = torch.tensor([p.temperature for p in params], device=dev)
    scaled = logits.float() / temp[:, None]  # [R, V]
    out = torch.empty(len(params), dtype=torch.long, device=dev)
    plain = [r for r, p in enumerate(params) if not 0 < p.top_k < vocab and p.top_p >= 1.0 and not p.min_p]
    if len(plain) == len(params):  # temperature alone: no candidates to choose, no sort
        return _draw(scaled.softmax(-1), generators)
    if plain:
        out[plain] = _draw(scaled[plain].softmax(-1), [generators[r] for r in plain])
    cut = [r for r in range(len(params)) if r not in set(plain)]
    if cut:
        out[cut] = _truncated(scaled[cut], [params[r] for r in cut], [generators[r] for r in cut])
    return out


def _truncated(scaled: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
    """Rows with top-k, top-p < 1 and/or min-p. Each row's candidates are its most likely
    tokens, in order: its top-k, else the ``NUCLEUS_CANDIDATES`` most likely when they hold all
    that top-p or min-p keeps, else the whole vocabulary sorted."""
    dev, vocab = scaled.device, scaled.shape[-1]
    window = min(vocab, NUCLEUS_CANDIDATES)
    width = max(p.top_k if 0 < p.top_k < vocab else window for p in params)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    # min-p: a token is kept where its logit is at least the row's highest plus log(min_p)
    floor = torch.tensor([p.min_p for p in params], device=dev).log()  # -inf where off
    lse = scaled.logsumexp(-1)  # [R]
    vals, idx = scaled.topk(width, dim=-1) if width < vocab else scaled.sort(dim=-1, descending=True)  # [R, N]
    if width < vocab:  # does the window hold what each row keeps? (one host sync)
        mass = (vals - lse[:, None]).exp().sum(-1)
        held = (top_k < vocab) | (mass >= top_p) | (vals[:, -1] < vals[:, 0] + floor)
        if not bool(held.all()):
            width = vocab
            vals, idx = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(width, device=dev)
    vals = vals.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
    # probabilities over the row's top-k, or over the whole vocabulary (not just the window)
    probs = (vals - torch.where(top_k < vocab, vals.logsumexp(-1), lse)[:, None]).exp()
    # top-p: keep the smallest prefix whose mass reaches top_p (always at least one token)
    probs = probs.masked_fill((probs.cumsum(-1) - probs) >= top_p[:, None], 0.0)
    probs = probs.masked_fill(vals < vals[:, :1] + floor[:, None], 0.0)  # min-p (the first always stays)
    return idx.gather(-1, _draw(probs, generators)[:, None])[:, 0]


DRAW_BLOCK = 1024  # tokens per block of the two-level inverse CDF


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One draw per row of ``probs`` [R, N] (rows need not be normalised) by inverting its
    cumulative sum at one uniform in (0, 1], in two levels: the block of ``DRAW_BLOCK`` tokens
    the uniform falls in (over the blocks' masses), then the token within it, both in float64
    (129k float32 terms would bias the rare tokens), so only one block is cumulated per row. A
    seeded row takes its uniform from its own generator, so its draw does not depend on its
    batch; the others share one draw on the device."""
    u = _uniforms(probs.shape[0], generators, probs.device)[:, None]  # [R, 1]
    rows, n = probs.shape
    if n <= DRAW_BLOCK:
        cdf = probs.double().cumsum(-1)  # [R, N]
        return torch.searchsorted(cdf, u * cdf[:, -1:]).clamp_(max=n - 1)[:, 0]
    whole = n // DRAW_BLOCK
    main = probs[:, : whole * DRAW_BLOCK].view(rows, whole, DRAW_BLOCK)  # [R, NB, B], no copy
    tail = probs[:, whole * DRAW_BLOCK :]  # [R, N - NB*B]: the last, shorter block
    mass = torch.cat([main.sum(-1), tail.sum(-1, keepdim=True)], 1).double()  # [R, NB + 1]
    cdf = mass.cumsum(-1)
    target = u * cdf[:, -1:]  # [R, 1]
    block = torch.searchsorted(cdf, target).clamp_(max=whole)  # [R, 1]
    inner = torch.zeros(rows, DRAW_BLOCK, dtype=probs.dtype, device=probs.device)
    in_main = block[:, 0] < whole
    at = torch.arange(rows, device=probs.device)
    inner[in_main] = main[at[in_main], block[in_main, 0]]
    inner[~in_main, : tail.shape[1]] = tail[~in_main]
    inner = inner.double().cumsum(-1)  # [R, B]
    # the mass left for the block, at most the block's own sum (rounding must not step past it)
    left = torch.minimum(target - (cdf.gather(-1, block) - mass.gather(-1, block)), inner[:, -1:])
    token = block * DRAW_BLOCK + torch.searchsorted(inner, left)
    return token.clamp_(max=n - 1)[:, 0]


def _uniforms(rows: int, generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """A uniform in (0, 1] per row, float64 [R]: a seeded row's from its own generator (so its
    draw does not depend on its batch), the others' from one draw on the device."""
    u = 1.0 - torch.rand(rows, device=device, dtype=torch.float64)
    for r, g in enumerate(generators):
        if g is not None:
            u[r] = 1.0 - float(torch.rand(1, generator=g, dtype=torch.float64))
    return u


def biased(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``logits`` [B, V] with each row's ``logit_bias`` added (a copy); ids past V are ignored
    (the ingress refuses them)."""
    logits = logits.clone()
    vocab = logits.shape[-1]
    for b, p in enumerate(params):
        pairs = [(t, v) for t, v in p.logit_bias if t < vocab]
        if pairs:
            ids, values = zip(*pairs, strict=True)
            logits[b].index_add_(0, torch.tensor(ids, device=logits.device),
                                 torch.tensor(values, dtype=logits.dtype, device=logits.device))
    return logits


def penalized(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int] | torch.Tensor | None] | None,
              seen: list[list[int] | torch.Tensor | None] | None = None) -> torch.Tensor:
    """``logits`` [B, V] with each row's penalties applied (a copy): presence and frequency on
    ``outputs[b]`` (row b's generated token ids, or its counts per token [V]: the engine keeps
    those, so the cost does not grow with the output), then the repetition penalty on
    ``seen[b]`` (its prompt's and output's ids, or a mask [V]): a seen token's logit is divided
    by it when positive and multiplied by it when not."""
    logits, vocab = logits.clone(), logits.shape[-1]
    for b, p in enumerate(params):
        if p.penalized and outputs is not None and outputs[b] is not None:
            counts = _per_token(outputs[b], logits)
            logits[b] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if p.repeats and seen is not None and seen[b] is not None:
            row, r = logits[b], p.repetition_penalty
            mask = seen[b] if isinstance(seen[b], torch.Tensor) and seen[b].dtype == torch.bool else \
                _per_token(seen[b], logits) > 0
            logits[b] = torch.where(mask[:vocab].to(logits.device), torch.where(row > 0, row / r, row * r), row)
    return logits


def _per_token(tokens: list[int] | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """How often each token of ``like``'s vocabulary occurs in ``tokens`` (ids, or counts or a
    mask per token), as ``like``'s dtype on its device [V] (ids past V are ignored)."""
    vocab = like.shape[-1]
    if isinstance(tokens, torch.Tensor):
        return tokens[:vocab].to(like.device, like.dtype)
    ids = torch.tensor([t for t in tokens if t < vocab], dtype=torch.long, device=like.device)
    return torch.bincount(ids, minlength=vocab).to(like.dtype)


def token_logprobs(logits: torch.Tensor, tokens: list[int], params: list[SamplingParams]) -> list[TokenLogprob | None]:
    """logits [B, V] and the tokens chosen from them -> row b's ``TokenLogprob`` where
    ``params[b].logprobs`` asks for one, else None."""
    out: list[TokenLogprob | None] = [None] * len(params)
    rows = [b for b, p in enumerate(params) if p.logprobs is not None]
    if rows:
        found = _logprobs(logits[rows], [tokens[b] for b in rows], [params[b].logprobs for b in rows])
        for b, lp in zip(rows, found, strict=True):
            out[b] = lp
    return out


def _logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int], ranks: bool = False) -> list[TokenLogprob]:
    """logits [R, V] -> row r's logprob of ``tokens[r]`` and its ``ks[r]`` most likely tokens,
    with ``ranks`` the token's rank too (computed on the logits' device; only those values come
    to the host)."""
    lp = logits.float().log_softmax(-1)  # [R, V]
    k = max(ks)
    top_v, top_i = lp.topk(min(k, lp.shape[-1]), dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    picked = lp.gather(1, torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None])  # [R, 1]
    place = ((lp > picked).sum(-1) + 1).tolist() if ranks else [0] * len(tokens)
    chosen, top_v, top_i = picked[:, 0].tolist(), top_v.cpu(), top_i.cpu()
    return [TokenLogprob(t, c, tuple(zip(top_i[r, :n].tolist(), top_v[r, :n].tolist(), strict=True)), rank)
            for r, (t, c, n, rank) in enumerate(zip(tokens, chosen, ks, place, strict=True))]


def next_token_logprobs(logits: torch.Tensor, next_ids: list[int], k: int) -> list[TokenLogprob]:
    """logits [T, V] of consecutive positions and the token that follows each (a prompt's own
    next tokens, T' <= T of them) -> each such token's logprob and rank, with the ``k`` most
    likely there (the prompt scored by the model: OpenAI's ``echo``, vLLM's ``prompt_logprobs``)."""
    return _logprobs(logits[: len(next_ids)], next_ids, [k] * len(next_ids), ranks=True) if next_ids else []
