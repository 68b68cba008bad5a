"""The app's arguments (``args:`` of a Serve config, ``tide up``'s options, KubeRay's
``serveConfigV2.args``) and the GPUs they take. Kept apart from ``deploy.app`` so that a command
can check them before it starts anything, without importing torch, Ray Serve and the replica.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from actors.replica_config import DEFAULT_NAMESPACE, AgentSection, ReplicaConfig, StoreSection
from cluster.engine_config import EngineConfig, PassPace
from cluster.prefix_affinity import AFFINITY_TOKENS, QUEUE_RATIO
from deploy.http_edge import OPTIONAL_PUBLIC_PATHS
from deploy.limits import KeyGrant, Limits

__all__ = ["AppArgs", "gpus_needed", "gpus_per_actor"]


def _defaults(cls) -> dict[str, object]:
    """A config dataclass's field defaults (its own are the only ones stated)."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


_ENGINE = EngineConfig()
_STORE, _REPLICA, _AGENTS = _defaults(StoreSection), _defaults(ReplicaConfig), _defaults(AgentSection)


class AppArgs(BaseModel):
    """Arguments of the app (``args:`` in a Serve config). Unset paths get local defaults;
    unknown fields are an error (a typo must not silently fall back to a default). The knobs'
    defaults are the typed configs' own (``EngineConfig``, ``ReplicaConfig`` and its sections),
    which ``engine_config`` and ``store_section`` build."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: str | None = None  # default: the built-in 'tiny' model
    model_name: str = "tiny"
    dtype: str = "float32"
    # "cuda": each replica takes one GPU (Ray's num_gpus) and runs the model there with the Triton
    # kernels; use dtype bfloat16 for real models
    device: Literal["cpu", "cuda"] = "cpu"
    # "int8": a CPU replica holds its projections and routed experts as int8 with a scale per 128
    # columns (model.quant): a quarter of the bytes a decode step streams; float32 CPU models only
    cpu_weights: Literal["fp32", "int8"] = "fp32"
    # a CPU replica's torch (and CPU kernel) threads; default: Ray's, one per CPU the replica
    # reserves (replica_cpus), or OMP_NUM_THREADS where set. `tide up` shares its machine's CPUs
    # but one among its replicas unless replica_cpus, cpu_threads or OMP_NUM_THREADS says otherwise
    cpu_threads: int | None = Field(default=None, ge=1)
    # an fp8 checkpoint's (DeepSeek-V3/R1 as published) projections and experts: auto keeps them
    # in fp8 on CUDA (the block-scaled fp8 GEMMs) and dequantizes them on the CPU; keep | dequantize
    fp8_weights: Literal["auto", "keep", "dequantize"] = "auto"
    replicas: int = Field(default=1, ge=1)
    # >0: P/D disaggregation: `replicas` prefill replicas hand each prompt's KV to this many decode
    # replicas (deployment LLMDecode, placed by free KV); 0: every replica does both
    decode_replicas: int = Field(default=0, ge=0)
    replica_cpus: float = Field(default=1.0, gt=0)
    max_replicas_per_node: int | None = Field(default=None, ge=1)  # 1: one DP replica per node
    cache_dir: str | None = None  # default: $TIDE_HOME/cache
    ssd_gb: float = Field(default=_STORE["ssd_bytes"] / 1e9, gt=0)
    cache_layout: Literal["unit", "segment"] = _STORE["layout"]  # unit files on disk: one per unit, or per write batch
    ram_mb: int = Field(default=_STORE["ram_bytes"] >> 20, ge=0)
    admission: str = _ENGINE.admission
    enable_cache: bool = True  # False: no unit store, no prefix sharing (benchmarks' baseline)
    # False: a replica keeps no finished prompt's pages for reuse, so every prefix hit comes from
    # the prompt cache (RAM/SSD/other nodes): the disk cache measured alone, as DeepSeek serves
    prefix_sharing: bool = _ENGINE.prefix_sharing
    num_pages: int = Field(default=_ENGINE.num_pages, ge=16)
    max_num_seqs: int = Field(default=_ENGINE.max_num_seqs, ge=1)
    max_prefill_tokens: int = Field(default=_ENGINE.max_prefill_tokens, ge=64)
    # >1: while requests decode, prefill chunks are sized so that nine in ten steps (the decode
    # tokens ride in the chunk's forward pass) take at most this many decode steps' time, with
    # a margin for how far recent steps ran past their prediction: bounded inter-token latency
    # under long prompts, at some cost to the long prompt's time to first token; 0: every chunk
    # is max_prefill_tokens. 2.5 keeps their p99 within 3 decode steps (tide bench engine's itl)
    itl_factor: float = Field(default=_ENGINE.itl_factor, ge=0)
    # with itl_factor on, a step that carries a prefill chunk may always take this long: where
    # decode steps take a millisecond or two (a small model), itl_factor of them would cut a long
    # prompt into chunks of a few tokens and multiply its time to first token; a pass of 10 ms is
    # no latency a reader of the stream notices. 0: itl_factor alone
    itl_floor_ms: float = Field(default=_ENGINE.itl_floor_ms, ge=0)
    # a scored prompt (echo with logprobs, prompt_logprobs) is computed in chunks whose logits
    # and their log-softmax fit this bound (MiB): the most memory scoring adds to a replica
    scored_logits_mib: int = Field(default=_ENGINE.scored_logits_mib, ge=1)
    # batch lines (/v1/batches) hold at most this share of a replica's seats and pages; interactive
    # requests preempt them when short
    background_share: float = Field(default=_ENGINE.background_share, ge=0, le=1)
    # ... and a decode step takes only as many as keep it within this much longer than the
    # interactive requests' own step (measured): batch work fills spare capacity only. None: 0.05
    # on a GPU, 0 (none beside interactive requests) on the CPU
    background_slack: float | None = Field(default=_ENGINE.background_slack, ge=0)
    # speculative decoding with the checkpoint's MTP layers, where it has them: drafts per
    # sequence and step (0: off, the MTP layers are not loaded). None: 1 on CUDA, 0 on the CPU,
    # where drafting gains about a tenth up to batch 4 but costs each prompt a quarter more prefill;
    # a step of more sequences than speculative_max_batch decodes without drafts
    speculative_tokens: int | None = Field(default=None, ge=0, le=8)
    speculative_max_batch: int = Field(default=_ENGINE.speculative_max_batch, ge=0)
    # benchmarks of routing on one machine ({pass_ms, token_ms, row_ms}): each CPU replica's
    # forward passes last at least what that emulated device takes for them (EngineConfig.pace),
    # so replicas sharing the machine's cores each have capacity of their own. None: off
    pace: PassPace | None = None
    # structured output's JSON: "compact" (separators as json.dumps writes them, no other
    # whitespace: a model cannot loop on blank runs) or "any" (runs of at most 16); a request's
    # structured_outputs.disable_any_whitespace decides for itself
    structured_whitespace: Literal["compact", "any"] = "compact"
    # a stream's outputs go at most this often (the first at once): what the engine made meanwhile
    # goes as one output, as Ray Serve LLM's setting of this name (and default) does. Each output
    # is a hop through the replica, the ingress and the HTTP proxy (~1.5 ms of CPU), so an engine
    # stepping faster would spend more sending tokens than making them; slower steps (a big
    # model's) go as they come. 0: each step's tokens at once
    stream_batching_interval_ms: float = Field(default=_REPLICA["stream_batching_interval_ms"], ge=0)
    directory_url: str | None = None  # e.g. redis://127.0.0.1:6379/0
    directory_namespace: str = DEFAULT_NAMESPACE  # one per cluster; several models share it safely
    cache_agents: bool = True  # a gRPC cache agent per node owns its units; False: per-replica store
    cache_replicas: int = Field(default=_AGENTS["replicas"], ge=1)  # R: copies of a hot unit (1: no replication)
    # the cache agents' token, read on each node from a 0600 file (default: $TIDE_AGENT_TOKEN_FILE;
    # `tide up` makes one in $TIDE_HOME/run) or an env var; with neither, one made by the app and kept
    # in Ray's internal KV (readable by every Ray job). Calls are signed with it, it is never sent
    agent_token_file: str | None = None
    agent_token_env: str | None = None
    # a file (mode 0600, on every node) holding the cluster's cache secret: unit keys are hashed
    # and units authenticated under it, so a unit forged by anyone holding the agent token is a
    # miss; replicas and the ingress read it, cache agents never do. Default: $TIDE_CACHE_SECRET_FILE
    # (`tide up` makes one in $TIDE_HOME/run); unset: units are checked for damage only
    cache_secret_file: str | None = None
    agent_tls_cert_file: str | None = None  # PEM files on every node: agents serve gRPC over TLS
    agent_tls_key_file: str | None = None  # (the certificate must name the node's IP)
    agent_tls_ca_file: str | None = None
    agent_tls_mutual: bool = False  # agents require a node certificate signed by agent_tls_ca_file (and present theirs)
    router: Literal["cache-aware", "round-robin", "prefix-affinity", "power-of-two"] = "cache-aware"
    affinity_tokens: int = Field(default=AFFINITY_TOKENS, ge=1)  # prefix-affinity: the prompt's first N tokens decide
    # prefix-affinity's bounded load: a replica more than ratio x the shortest queue (+2) and gap requests longer is passed over
    affinity_queue_ratio: float = Field(default=QUEUE_RATIO, ge=1.0)
    affinity_queue_gap: int = Field(default=0, ge=0)
    # at night, before a node is lent: its units that no staying node holds (the hot first) are copied
    # to the nodes that stay, at most this many bytes per node within this many seconds (0 bytes: off)
    night_keep_bytes: int = Field(default=8 << 30, ge=0)
    night_keep_s: float = Field(default=60.0, ge=0)
    directory_password_env: str | None = None  # name of the env var holding the Redis password
    directory_tls_ca_file: str | None = None  # PEM CA of the Redis server's certificate (rediss:// URLs)
    usage_dir: str | None = None  # per-request usage logs for `tide stats` (default: $TIDE_HOME/usage)
    # the Files and Batch APIs' file bodies, on a disk every ingress replica reaches (default:
    # $TIDE_HOME/files); their records and the batch jobs live in the directory's Redis
    files_dir: str | None = None
    expert_shards: int = Field(default=0, ge=0)  # >0: routed experts on this many expert-shard actors
    expert_slots: int | None = Field(default=None, ge=1)  # physical slots in all (default: +1 per shard)
    expert_rebalance_s: float = Field(default=0.0, ge=0)  # re-plan placement this often (0: `tide eplb rebalance`)
    micro_batches: int = Field(default=_ENGINE.micro_batches, ge=1, le=2)  # 2: overlap expert rounds with attention
    # True: no CUDA graphs; every decode step runs eagerly (as vLLM's --enforce-eager)
    enforce_eager: bool = _ENGINE.enforce_eager
    # how expert-parallel rows travel: fp8 dispatch + bf16 combine (DeepSeek's), the model's dtype
    # (native), or auto: fp8 for a bfloat16 model, else native
    ep_wire: Literal["auto", "native", "fp8"] = "auto"
    # what moves expert-parallel rows: nccl (GPU to GPU), gloo (host memory), auto (nccl on CUDA)
    ep_backend: Literal["auto", "gloo", "nccl"] = "auto"
    # key -> "TENANT" or "TENANT:MODEL[+MODEL...]" (the models it may use; default all);
    # also TIDE_API_KEYS="key:TENANT[:MODEL+...],..."
    api_keys: dict[str, str] | None = None
    # with keys, only /health and /version answer without one; list any of /metrics, /docs,
    # /redoc, /openapi.json here to serve them without a key too (e.g. a Prometheus without one)
    public_paths: list[str] = Field(default_factory=list)
    limits: dict[str, int] | None = None
    # the HTTP ingress runs on the head node (beside its proxy), so losing or lending a worker node
    # never loses a request's ingress — only its replica, and the request continues elsewhere;
    # False: anywhere Serve places it
    ingress_on_head: bool = True


    def engine_config(self) -> EngineConfig:
        """The replicas' engine (prefix sharing only where the cache is on)."""
        return EngineConfig(num_pages=self.num_pages, max_num_seqs=self.max_num_seqs,
                            max_prefill_tokens=self.max_prefill_tokens, admission=self.admission,
                            prefix_sharing=self.enable_cache and self.prefix_sharing, micro_batches=self.micro_batches,
                            itl_factor=self.itl_factor, itl_floor_ms=self.itl_floor_ms,
                            enforce_eager=self.enforce_eager, scored_logits_mib=self.scored_logits_mib,
                            background_share=self.background_share, background_slack=self.background_slack,
                            speculative_tokens=self.drafts_per_step,
                            speculative_max_batch=self.speculative_max_batch, pace=self.pace)

    @property
    def drafts_per_step(self) -> int:
        """``speculative_tokens``, or where unset what pays on the device: 1 on CUDA, 0 on the CPU."""
        if self.speculative_tokens is not None:
            return self.speculative_tokens
        return 1 if self.device == "cuda" else 0

    def store_section(self, default_dir: str) -> StoreSection:
        """Each node's unit store (under ``default_dir`` unless ``cache_dir`` names one)."""
        return StoreSection(self.cache_dir or default_dir, int(self.ssd_gb * 1e9), self.cache_layout,
                            self.ram_mb << 20, self.admission)

    @field_validator("itl_factor")
    @classmethod
    def _itl(cls, v: float) -> float:
        if v != 0 and v <= 1:
            raise ValueError(f"itl_factor must be 0 (off) or > 1, got {v}")
        return v

    @field_validator("pace")
    @classmethod
    def _pace(cls, pace: PassPace | None, info: ValidationInfo) -> PassPace | None:
        if pace is not None and info.data.get("device") == "cuda":
            raise ValueError("pace emulates a device on the CPU; a cuda replica's passes take their own time")
        return pace

    @field_validator("limits")
    @classmethod
    def _limits(cls, limits: dict[str, int] | None) -> dict[str, int] | None:
        if limits:
            Limits(**limits)  # ValueError naming a misspelled or out-of-range limit
        return limits

    @field_validator("public_paths")
    @classmethod
    def _public(cls, paths: list[str]) -> list[str]:
        bad = sorted(set(paths) - OPTIONAL_PUBLIC_PATHS)
        if bad:
            raise ValueError(f"public_paths may name {', '.join(sorted(OPTIONAL_PUBLIC_PATHS))}; not {', '.join(bad)}")
        return paths

    @field_validator("api_keys")
    @classmethod
    def _grants(cls, keys: dict[str, str] | None) -> dict[str, str] | None:
        for key, grant in (keys or {}).items():
            if not key:
                raise ValueError("api_keys has an empty key")
            KeyGrant.parse(grant)  # ValueError naming the bad grant
        return keys


def gpus_per_actor(device: str) -> int:
    """Each replica and each expert shard takes one GPU of its own under ``device="cuda"``."""
    return 1 if device == "cuda" else 0


def gpus_needed(a: AppArgs) -> int:
    """GPUs the app takes: one per (prefill or decode) replica and one per expert shard under
    ``device="cuda"``."""
    return (a.replicas + a.decode_replicas + a.expert_shards) * gpus_per_actor(a.device)
