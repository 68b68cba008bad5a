"""The engine's configuration (torch-free: the app's arguments take their defaults from it)."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.units import UNIT_TOKENS

__all__ = ["EngineConfig", "PassPace"]


@dataclass(frozen=True, slots=True)
class PassPace:
    """An emulated device's pass times: a forward pass of ``tokens`` prompt tokens and ``rows``
    decode rows lasts at least ``pass_ms + tokens * token_ms + rows * row_ms``. Replicas that
    share one machine's cores (a simulated cluster) then each have a device's capacity of their
    own, as replicas on separate GPUs do: routing is measured where a replica's queue, not the
    machine's cores, sets its TTFT."""

    pass_ms: float = 0.0
    token_ms: float = 0.0
    row_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("pass_ms", "token_ms", "row_ms"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"pace {name} must be a finite number of ms >= 0, got {getattr(self, name)}")

    def seconds(self, tokens: int, rows: int) -> float:
        """The least a pass of ``tokens`` prompt tokens and ``rows`` decode rows lasts."""
        return (self.pass_ms + tokens * self.token_ms + rows * self.row_ms) / 1e3


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """An engine's knobs; their defaults are the serving defaults (``deploy.app_args.AppArgs``
    takes its own from here)."""

    num_pages: int = 4096
    page_size: int = 16
    max_num_seqs: int = 16
    max_prefill_tokens: int = 2048
    load_timeout_s: float = 5.0
    admission: str = "all"  # unit-granular policies only: "all" | "second-sight"
    prefix_sharing: bool = True  # reuse pages of finished prompts in this replica
    micro_batches: int = 1  # 2: decode in two pipelined halves (hides expert-parallel rounds)
    # While sequences decode, a prefill chunk is sized from measured speeds so that nine in ten
    # steps take at most this many decode steps' time (their inter-token latency stays bounded);
    # 0: every chunk is max_prefill_tokens long. 2.5 keeps their p99 within 3 decode steps
    # (tide bench engine's itl)
    itl_factor: float = 2.5
    # with itl_factor on, a step with a prefill chunk may always take this long (ms), where
    # itl_factor decode steps are shorter: decode steps of a millisecond would otherwise cut a
    # prompt into chunks of a few tokens, each paying a pass's overhead (0: no floor); a pass of
    # 10 ms is no latency a reader of the stream notices
    itl_floor_ms: float = 10.0
    # True: every decode step runs eagerly; False: on a CUDA model whose experts are local, decode
    # steps without a prefill chunk replay a CUDA graph captured per batch bucket (model.fixed_decode)
    enforce_eager: bool = False
    # a scored prompt's chunk holds its logits [T, V] and their log-softmax (float32): T is the
    # most whose two fit this bound (at most scheduler.SCORED_CHUNK)
    scored_logits_mib: int = 256
    # background requests (batch lines) hold at most this share of the seats and of the pages; the
    # rest stays free for interactive arrivals, which preempt background work when short
    background_share: float = 0.5
    # ... and a decode step takes only as many of them as keep it within this much longer than the
    # interactive rows' own step (measured): batch work uses the spare capacity, not the latency.
    # 0: none beside interactive rows. None: 0.05 on a GPU; 0 on the CPU, whose cores the engine's
    # compute shares with the HTTP path of the interactive requests (no spare capacity there)
    background_slack: float | None = None
    # speculative decoding with the checkpoint's MTP layers (when they are loaded): drafts verified
    # per sequence and step (0: off); a step of more sequences than speculative_max_batch decodes
    # without drafts, where verifying costs more than it saves
    speculative_tokens: int = 0
    speculative_max_batch: int = 8
    # after a decode pass the batch waits at most this long (ms) for the token masks filled
    # while it ran; a constrained row whose mask is later sits the step out (the others go on)
    # and decodes the same position in the next: one slow grammar never stalls the batch
    mask_wait_ms: float = 5.0
    # a prefix loaded from this node's SSD is handed over layer by layer while the suffix computes
    # (cachedir.layered): None = on where the engine computes on a GPU, whose passes leave the
    # host's cores to the reads; on a CPU the reads and the compute share the cores and the GIL
    # (measured slower there: tide bench ttft's local_agent_ssd_layered)
    layered_loads: bool | None = None
    # benchmarks of routing on one machine: every forward pass lasts at least what this emulated
    # device takes for it (the rest slept, which leaves the cores to the other replicas); CPU only
    pace: PassPace | None = None

    def __post_init__(self) -> None:
        if self.admission not in ("all", "second-sight"):
            raise ValueError(
                f"admission policy {self.admission!r} is not available for serving; use all or second-sight"
            )
        if UNIT_TOKENS % self.page_size:
            raise ValueError(f"page_size {self.page_size} must divide the {UNIT_TOKENS}-token unit")
        if self.micro_batches not in (1, 2):
            raise ValueError(f"micro_batches must be 1 or 2, got {self.micro_batches}")
        for name in ("speculative_tokens", "speculative_max_batch"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("num_pages", "max_num_seqs", "max_prefill_tokens", "scored_logits_mib"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.itl_factor != 0 and self.itl_factor <= 1:
            raise ValueError(f"itl_factor must be 0 (off) or > 1, got {self.itl_factor}")
        if not 0 <= self.background_share <= 1:
            raise ValueError(f"background_share must be in [0, 1], got {self.background_share}")
        if self.background_slack is not None and not self.background_slack >= 0:
            raise ValueError(f"background_slack must be >= 0, got {self.background_slack}")
        if not self.mask_wait_ms >= 0:
            raise ValueError(f"mask_wait_ms must be >= 0, got {self.mask_wait_ms}")
        if not self.itl_floor_ms >= 0:
            raise ValueError(f"itl_floor_ms must be >= 0, got {self.itl_floor_ms}")
