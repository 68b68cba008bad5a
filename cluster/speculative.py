"""Speculative decoding with the checkpoint's MTP layers: drafts, verify rows, acceptance counts.

Each running sequence carries the tokens the MTP layers proposed after its last step
(``Sequence.drafts``). A decode step verifies them in the same forward pass as the sequence's
next token: its rows are the last token and each draft at consecutive positions, so the pass
gives the target's logits after each. The engine then samples row by row, exactly as decoding a
token at a time would (the same constraints, penalties, stop rules and random draws): a draft is
accepted when the token sampled at its position equals it, and the next row counts only then.
Sampling the target and comparing is rejection sampling for a draft that puts all its mass on
one token, so outputs follow the target distribution, and greedy and seeded outputs are those
of decoding without drafts.

After sampling, the MTP layers read the committed positions (their latents go into the pool
beside the model's) and propose the next drafts. Where the C++ steps run the pass, MTP layer 0
runs in the same call over every row, guessing each row's token is its argmax
(``DeepseekModel.verify_draft``): a sequence whose committed tokens are those guesses (every one
decoded greedily) takes its draft from there, the others run the layer again over their
committed rows. KV written for rejected drafts lies past the sequence's computed tokens: pages,
prefix sharing, cache units and persist triggers only read committed positions, and the next
step writes over it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from cluster.kv_manager import long_tensor
from cluster.request import Sequence

__all__ = ["Guessed", "SpecStats", "Speculator", "VerifyRows"]


@dataclass(slots=True)
class SpecStats:
    """Drafts verified and accepted per draft position (vLLM's spec_decode counters)."""

    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted, self.drafted, strict=True)]

    def as_dict(self) -> dict:
        return {"draft_tokens": list(self.drafted), "accepted_tokens": list(self.accepted),
                "acceptance": [round(x, 4) for x in self.acceptance()]}


@dataclass(slots=True)
class VerifyRows:
    """A decode pass's rows: each sequence's last token, then its drafts at the next positions."""

    tables: torch.Tensor  # [R, W]
    tokens: torch.Tensor  # [R]
    positions: torch.Tensor  # [R]
    first: list[int]  # each sequence's first row


@dataclass(slots=True)
class Guessed:
    """MTP layer 0 run in the verify pass, each row's argmax taken as the token after it."""

    tokens: list[int]  # [R] each row's argmax
    drafts: list[int]  # [R] the draft after each row
    normed: torch.Tensor  # [R, M] the MTP's normed hidden states (a chained draft's input)


class Speculator:
    def __init__(self, model, kv, tokens: int, max_batch: int) -> None:
        """``tokens`` drafts per sequence and step (0, or a model without MTP layers: off);
        ``max_batch``: more sequences than this decode without drafts."""
        self.model, self.kv = model, kv
        self.tokens = tokens if getattr(model, "mtp", None) else 0
        self.max_batch = max_batch
        self.stats = SpecStats([0] * self.tokens, [0] * self.tokens)
        self.fixed_draft = None  # MTP layer 0's pass of fixed shape (model.fixed_decode), on CUDA

    def _draft(self, layer: int, hidden: torch.Tensor, next_ids: torch.Tensor, tables: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``model.draft`` over these rows (replaying a captured step where there is one)."""
        if layer == 0 and self.fixed_draft is not None:
            return self.fixed_draft(next_ids, tables, positions, hidden)
        return self.model.draft(layer, hidden, next_ids, self.kv.pool, tables, positions)

    @property
    def enabled(self) -> bool:
        """Whether the MTP layers run (prompts' positions too, so their latents are kept)."""
        return self.tokens > 0

    def active(self, batch: list[Sequence]) -> bool:
        """Whether this step's ``batch`` verifies drafts (and the MTP layers propose new ones);
        when not, their drafts are dropped."""
        on = self.enabled and 0 < len(batch) <= self.max_batch
        if self.enabled and not on:  # (an engine that never drafts has none to drop)
            for seq in batch:
                seq.drafts = []
        return on

    def rows(self, batch: list[Sequence]) -> VerifyRows:
        """The verify rows of ``batch`` (its block-table rows in order): drafts that would pass the
        request's ``max_tokens`` or the context, or find no free page, are dropped."""
        limit = self.model.cfg.max_position_embeddings
        tokens, positions, counts, first = [], [], [], []
        for seq in batch:
            p = seq.num_computed  # the last token's position: its KV is not computed yet
            room = min(seq.req.max_tokens - len(seq.output_ids) - 1, limit - p - 1)
            drafts = seq.drafts[: max(0, room)]
            while drafts and not self.kv.grow_to(seq, p + len(drafts) + 1):
                drafts.pop()
            seq.drafts = drafts
            first.append(len(tokens))
            tokens += [seq.output_ids[-1], *drafts]
            positions += range(p, p + len(drafts) + 1)
            counts.append(len(drafts) + 1)
            for j in range(len(drafts)):
                self.stats.drafted[j] += 1
        tables = self.kv.tables(batch)
        if len(tokens) != len(batch):  # each sequence's row of the block table, once per verify row
            tables = tables.index_select(0, long_tensor([b for b, n in enumerate(counts) for _ in range(n)])
                                         .to(tables.device))
        return VerifyRows(tables, long_tensor(tokens), long_tensor(positions), first)

    def accepted(self, j: int) -> None:
        self.stats.accepted[j] += 1

    def verify(self, rows: VerifyRows, micro_batches: int = 1) -> tuple[torch.Tensor, torch.Tensor, Guessed | None]:
        """The verify pass over ``rows``: (fp32 logits [R, V], normed hidden states [R, M], MTP
        layer 0's guesses where it ran in the same call, else None)."""
        out = self.model.verify_draft(rows.tokens, self.kv.pool, rows.tables, rows.positions)
        if out is None:
            logits, hidden = self.model.decode(rows.tokens, self.kv.pool, rows.tables, rows.positions,
                                               micro_batches=micro_batches, hidden=True)
            return logits, hidden, None
        logits, hidden, tokens, drafts, normed = out
        return logits, hidden, Guessed(tokens.tolist(), drafts.tolist(), normed)

    def propose(self, seqs: list[Sequence], hidden: torch.Tensor, rows: list[list[int]],
                guessed: Guessed | None = None) -> None:
        """New drafts for ``seqs``: the MTP layers over each one's committed positions of this
        pass (``rows[i]``: their rows of ``hidden``, the pass's normed hidden states), the
        committed tokens after each as inputs; chained to ``tokens`` drafts. A sequence whose
        committed tokens are ``guessed``'s takes its first draft from there."""
        if guessed is not None:
            hit = [seq.output_ids[-len(r):] == [guessed.tokens[i] for i in r] for seq, r in zip(seqs, rows, strict=True)]
            last = [r[-1] for r, h in zip(rows, hit, strict=True) if h]
            if last:
                self._chain([s for s, h in zip(seqs, hit, strict=True) if h], [guessed.drafts[i] for i in last],
                            guessed.normed[long_tensor(last)])
            # the rest (sampled off their argmax) run the layer again over their committed rows
            seqs = [s for s, h in zip(seqs, hit, strict=True) if not h]
            rows = [r for r, h in zip(rows, hit, strict=True) if not h]
        if not seqs:
            return
        ids, positions, counts = [], [], []
        for seq, r in zip(seqs, rows, strict=True):
            n = len(r)
            ids += seq.output_ids[-n:]
            positions += range(seq.num_computed - n, seq.num_computed)
            counts.append(n)
        tables = self.kv.tables(seqs)
        tables = tables.repeat_interleave(long_tensor(counts).to(tables.device), dim=0)
        flat = long_tensor([i for r in rows for i in r])
        logits, normed = self._draft(0, hidden.index_select(0, flat.to(hidden.device)), long_tensor(ids), tables,
                                     long_tensor(positions))
        last = long_tensor([end - 1 for end in accumulate(counts)])  # each sequence's last row
        self._chain(seqs, logits[last].argmax(dim=-1).tolist(), normed[last])

    def propose_one(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """``seq``'s first drafts, after its prompt: the MTP layers at the prompt's last
        position (``hidden`` [M]) with the first output token as input."""
        pos = long_tensor([seq.num_computed - 1])
        logits, normed = self._draft(0, hidden[None], long_tensor([seq.output_ids[-1]]), self.kv.tables([seq]), pos)
        self._chain([seq], logits.argmax(dim=-1).tolist(), normed)

    def _chain(self, seqs: list[Sequence], drafts: list[int], normed: torch.Tensor) -> None:
        """``drafts``: each sequence's first (MTP layer 0's argmax at its last committed
        position), then the layers again over each draft (its normed hidden state [S, M] as
        input) while more are asked for and pages allow."""
        for seq, d in zip(seqs, drafts, strict=True):
            seq.drafts = [d]
        n_layers = len(self.model.mtp)
        for depth in range(1, self.tokens):
            live = [i for i, s in enumerate(seqs) if self.kv.grow_to(s, s.num_computed + depth)]
            if not live:
                return
            group = [seqs[i] for i in live]
            idx = long_tensor(live)
            positions = long_tensor([s.num_computed + depth - 1 for s in group])
            logits, normed = self._draft(depth % n_layers, normed.index_select(0, idx.to(normed.device)),
                                         long_tensor([s.drafts[-1] for s in group]), self.kv.tables(group), positions)
            for seq, d in zip(group, logits.argmax(dim=-1).tolist(), strict=True):
                seq.drafts.append(d)
            seqs = group
