"""Training the tideserve architecture (next-token prediction), resumable, in HF checkpoint format.

Legend: B sequences per step, T tokens per sequence, M hidden, V vocab, E routed experts.

The forward pass reuses the serving model's layers (the same MLA projections, naive attention,
gates and SwiGLU experts) on tensors that require grad, without the paged pool: one causal pass
per sequence. Routed experts run through the differentiable torch reference; the V3 gate's
``e_score_correction_bias`` is trained the way DeepSeek-V3 balances load without an auxiliary
loss: after each step it moves by ``bias_rate`` towards under-loaded experts.

The corpus is English that ships with every Python: the docstrings of the standard library.
Half of the documents are shaped as a chat turn (the user names the function or class, the
assistant answers with its docstring), so a chat request gets documentation-like English back.
The ``mixed`` corpus also answers briefly (a docstring's first sentence) and in JSON (compact,
short strings and small numbers about the documented name, the separators structured output
uses), so chat answers end and constrained outputs close their strings and objects.

Checkpoints are written atomically to ``out`` (``config.json`` + ``model.safetensors`` +
``trainer_state.pt`` with the optimizer, step and RNG), so a killed or stopped run resumes.
"""

from __future__ import annotations

import ast
import json
import math
import pickle
import random
import sysconfig
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.cpu_gemv import ref_moe_routed
from model.checkpoint import (
    build_model,
    load_config,
    load_state_dict,
    random_state_dict,
    save_checkpoint,
)
from model.config import ModelConfig
from model.layers import rms_norm
from model.model import DeepseekModel
from model.mtp import mtp_prefix
from model.tokenizer import ByteTokenizer

__all__ = ["CORPORA", "TrainConfig", "Trainer", "encode_corpus", "stdlib_documents"]

CORPORA = ("docstrings", "mixed")

FUSED = "gate_up_proj.weight"  # dense MLP gate and up rows, fused (see model.checkpoint.build_model)


@dataclass(frozen=True, slots=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 50
    weight_decay: float = 0.01
    bias_rate: float = 1e-3
    seed: int = 0
    checkpoint_every: int = 100
    mtp_weight: float = 0.3  # the MTP layers' mean loss, weighted beside the main loss (DeepSeek-V3's 0.3)
    only_mtp: bool = False  # train the MTP layers alone: the main model's weights stay as they are

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 32:
            raise ValueError(f"seq_len must be >= 32, got {self.seq_len}")
        if not 0 < self.min_lr <= self.lr:
            raise ValueError(f"need 0 < min_lr ({self.min_lr}) <= lr ({self.lr})")


def stdlib_documents(root: Path | None = None, limit: int | None = None) -> list[tuple[str, str]]:
    """(name, docstring) of modules, classes and functions of the standard library, sorted."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    docs: list[tuple[str, str]] = []
    for path in sorted(root.rglob("*.py")):
        if any(part in ("test", "tests", "idle_test", "site-packages") for part in path.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 40 and doc.isascii():
                    name = path.stem if isinstance(node, ast.Module) else f"{path.stem}.{node.name}"
                    docs.append((name, doc))
        if limit is not None and len(docs) >= limit:
            return docs[:limit]
    return docs


def encode_corpus(docs: list[tuple[str, str]], seed: int, corpus: str = "docstrings") -> torch.Tensor:
    """One token stream, EOS between documents. ``docstrings``: each document as plain text or
    as a chat turn; ``mixed``: also as a brief chat answer or a JSON answer (``json_answer``)."""
    if corpus not in CORPORA:
        raise ValueError(f"corpus must be one of {', '.join(CORPORA)}, got {corpus!r}")
    tok = ByteTokenizer()
    rng = random.Random(seed)
    ids: list[int] = []
    for name, doc in docs:
        r = rng.random()
        if corpus == "docstrings":
            turn = ("chat", doc) if r < 0.5 else ("plain", doc)
        else:
            turn = ("plain", doc) if r < 0.3 else ("chat", doc) if r < 0.5 else \
                ("chat", first_sentence(doc)) if r < 0.7 else ("json", json_answer(name, doc, rng))
        kind, text = turn
        if kind == "plain":
            ids += [tok.BOS] + tok.encode(text) + [tok.EOS]
            continue
        ask = name if kind == "chat" else rng.choice([name, f"{name} as JSON", f"Describe {name} in JSON."])
        messages = [{"role": "user", "content": ask}]
        if kind == "json" and rng.random() < 0.5:
            messages.insert(0, {"role": "system", "content": rng.choice(["Reply in JSON.", "Answer with a JSON object."])})
        ids += tok.apply_chat_template(messages) + tok.encode(text) + [tok.EOS]
    return torch.tensor(ids, dtype=torch.long)


def first_sentence(doc: str, limit: int = 200) -> str:
    """A docstring's first sentence (its first paragraph, cut at the first full stop), at most
    ``limit`` characters."""
    para = " ".join(doc.split("\n\n")[0].split())
    end = para.find(". ")
    return (para if end < 0 else para[: end + 1])[:limit]


def json_answer(name: str, doc: str, rng: random.Random) -> str:
    """A compact JSON object about a documented name: a few of its facts (short strings, small
    numbers, a flag, a short list) in a random choice and order, with the separators structured
    output writes (", " and ": ")."""
    words = [w.strip(".,:;()`'\"") for w in first_sentence(doc).split()]
    words = [w for w in words if w.isalpha()]
    module, _, short = name.rpartition(".")
    facts = {
        "name": short or name, "module": module or name, "kind": "module" if not module else "member",
        "summary": " ".join(words[: rng.randint(2, 6)]), "words": len(doc.split()), "lines": doc.count("\n") + 1,
        "public": not (short or name).startswith("_"), "tags": sorted({w.lower() for w in words[:8] if len(w) > 3})[:3],
        "id": rng.randint(0, 99),
    }
    keys = rng.sample(list(facts), rng.randint(2, 5))
    return json.dumps({k: facts[k] for k in keys}, separators=(", ", ": "))


class Trainer:
    def __init__(self, cfg: ModelConfig, train: TrainConfig, out: str | Path, corpus: torch.Tensor,
                 init_from: str | Path | None = None) -> None:
        """``cfg``'s ``num_nextn_predict_layers`` MTP layers train beside the model (each
        predicting one token further, chained, as DeepSeek-V3 trains them). ``init_from``: start
        from that checkpoint's weights (MTP layers it lacks start random)."""
        if corpus.numel() < train.seq_len + 2:
            raise ValueError(f"the corpus has {corpus.numel()} tokens; seq_len {train.seq_len} needs more")
        if train.only_mtp and not cfg.num_nextn_predict_layers:
            raise ValueError("only_mtp trains the MTP layers, and the config has none")
        self.cfg, self.train, self.out, self.corpus = cfg, train, Path(out), corpus
        self.step = 0
        state_file = self.out / "trainer_state.pt"
        if state_file.is_file():  # resume
            self.cfg = load_config(self.out)
            self.params = load_state_dict(self.out, self.cfg)
            try:  # tensors and plain values only: a planted pickle must not run code on resume
                state = torch.load(state_file, weights_only=True)
            except pickle.UnpicklingError as e:
                raise ValueError(f"{state_file} holds more than tensors and plain values; refusing to load it "
                                 f"({str(e).splitlines()[0]})") from None
            self.step = state["step"]
        elif init_from is not None:
            self.params = random_state_dict(cfg, seed=train.seed)
            self.params.update(load_state_dict(init_from, cfg))  # fp32 for training; its MTP layers, if any
            state = None
        else:
            self.params = random_state_dict(cfg, seed=train.seed)
            state = None
        # Routed experts train as one stacked tensor per layer and projection ([E, 2I, M], [E, M, I])
        # and dense MLPs with gate and up fused, as the serving model holds them; ``hf_state_dict``
        # splits both back into Hugging Face names.
        self.experts = {}
        mtp_layers = self.cfg.num_hidden_layers + self.cfg.num_nextn_predict_layers
        for i in range(mtp_layers):
            if self.cfg.is_moe_layer(i):
                p = f"model.layers.{i}.mlp.experts."
                self.experts[i] = (
                    torch.stack([torch.cat((self.params.pop(f"{p}{e}.gate_proj.weight"), self.params.pop(f"{p}{e}.up_proj.weight")))
                                 for e in range(self.cfg.n_routed_experts)]),
                    torch.stack([self.params.pop(f"{p}{e}.down_proj.weight") for e in range(self.cfg.n_routed_experts)]),
                )
        for name in [k for k in self.params if k.endswith(".gate_proj.weight")]:
            prefix = name.removesuffix("gate_proj.weight")
            self.params[prefix + FUSED] = torch.cat((self.params.pop(name), self.params.pop(prefix + "up_proj.weight")))
        trainable = {k: v for k, v in self.params.items() if not k.endswith("e_score_correction_bias")}
        for i, (gate_up, down) in self.experts.items():
            trainable[f"model.layers.{i}.experts.gate_up"], trainable[f"model.layers.{i}.experts.down"] = gate_up, down
        if train.only_mtp:
            drafts = tuple(mtp_prefix(self.cfg, k) for k in range(self.cfg.num_nextn_predict_layers))
            trainable = {k: v for k, v in trainable.items() if k.startswith(drafts)}
        for t in trainable.values():
            t.requires_grad_(True)
        decay = [t for k, t in trainable.items() if t.dim() >= 2]
        no_decay = [t for k, t in trainable.items() if t.dim() < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=train.lr, betas=(0.9, 0.95),
        )
        self.rng = torch.Generator().manual_seed(train.seed)
        if state is not None:
            self.opt.load_state_dict(state["optimizer"])
            self.rng.set_state(state["rng"])
        self.model = build_model(self.cfg, self.params, impl="ref")  # computes with these very tensors
        self._expert_load: dict[int, torch.Tensor] = {}
        self.model.set_expert_executor(self._experts)
        self.last_mtp_loss: float | None = None

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor under its Hugging Face name (experts split out of their stacks)."""
        sd = {}
        for k, v in self.params.items():
            if k.endswith(FUSED):
                gate, up = v.detach().chunk(2)
                sd[k.removesuffix(FUSED) + "gate_proj.weight"] = gate.contiguous()
                sd[k.removesuffix(FUSED) + "up_proj.weight"] = up.contiguous()
            else:
                sd[k] = v.detach()
        inter = self.cfg.moe_intermediate_size
        for i, (gate_up, down) in self.experts.items():
            for e in range(self.cfg.n_routed_experts):
                p = f"model.layers.{i}.mlp.experts.{e}."
                sd[p + "gate_proj.weight"] = gate_up[e, :inter].detach().contiguous()
                sd[p + "up_proj.weight"] = gate_up[e, inter:].detach().contiguous()
                sd[p + "down_proj.weight"] = down[e].detach().contiguous()
        return sd

    # -- the forward pass ---------------------------------------------------------------
    def _experts(self, layer_idx: int, x, ids, weights):
        gate_up, down = self.experts[layer_idx]
        counts = torch.bincount(ids.reshape(-1), minlength=self.cfg.n_routed_experts).float()
        self._expert_load[layer_idx] = self._expert_load.get(layer_idx, 0) + counts
        return ref_moe_routed(x, ids, weights, gate_up, down)

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy over ``batch`` [B, T+1], plus ``mtp_weight`` times the
        MTP layers' mean loss: projections, MLPs and experts run on all B*T tokens at once,
        attention per sequence. With ``only_mtp`` the model's own pass records no gradient."""
        model: DeepseekModel = self.model
        eps = self.cfg.rms_norm_eps
        b, t = batch.shape[0], batch.shape[1] - 1
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.train.only_mtp):
            h = self.params["model.embed_tokens.weight"][batch[:, :-1].reshape(-1)]  # [B*T, M]
            for layer in model.layers:
                h = self._layer(layer, h, b, t)
            normed = rms_norm(h, model.norm, eps)
            main = F.cross_entropy(F.linear(normed, model.lm_head), batch[:, 1:].reshape(-1))
        if not model.mtp:
            return main
        losses = []
        for k, mtp in enumerate(model.mtp):  # layer k: position i reads token i+k+1, predicts i+k+2
            t_k = t - k - 1
            prev = normed.view(b, -1, normed.shape[-1])[:, :t_k].reshape(-1, normed.shape[-1])
            x = mtp.inputs(prev, batch[:, k + 1 : k + 1 + t_k].reshape(-1), eps)
            normed = rms_norm(self._layer(mtp.layer, x, b, t_k), mtp.head_norm, eps)
            losses.append(F.cross_entropy(F.linear(normed, mtp.lm_head), batch[:, k + 2 : k + 2 + t_k].reshape(-1)))
        mtp_loss = torch.stack(losses).mean()
        self.last_mtp_loss = mtp_loss.item()
        return mtp_loss if self.train.only_mtp else main + self.train.mtp_weight * mtp_loss

    def _layer(self, layer, h: torch.Tensor, b: int, t: int) -> torch.Tensor:
        """One decoder layer over B sequences of T tokens each (``h`` [B*T, M]), causal."""
        cos, sin = self.model.rope.cos_sin(torch.arange(t), torch.float32)
        cos, sin = cos.repeat(b, 1), sin.repeat(b, 1)  # [B*T, P/2]
        x = rms_norm(h, layer.input_norm, self.cfg.rms_norm_eps)
        q_nope, q_rope, latent, _ = layer.attn.project(x, cos, sin)
        o = torch.cat([
            layer.attn.attend_naive(q_nope[i * t : (i + 1) * t], q_rope[i * t : (i + 1) * t],
                                    latent[i * t : (i + 1) * t], 0)
            for i in range(b)
        ])  # [B*T, H, V]
        h = h + layer.attn.output(o)
        x = rms_norm(h, layer.post_attn_norm, self.cfg.rms_norm_eps)
        return h + layer.mlp(x)  # MoE layers route to ``_experts`` (set as their executor)

    # -- the loop -------------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        t = self.train
        if step < t.warmup_steps:
            return t.lr * (step + 1) / t.warmup_steps
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
        return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))

    def sample_batch(self) -> torch.Tensor:
        n = self.train.seq_len + 1
        starts = torch.randint(0, self.corpus.numel() - n, (self.train.batch_size,), generator=self.rng)
        return torch.stack([self.corpus[s : s + n] for s in starts.tolist()])

    def run(
        self,
        deadline_s: float | None = None,
        should_stop: Callable[[], bool] = lambda: False,
        report: Callable[[dict], None] = lambda row: None,
    ) -> dict:
        """Train until ``train.steps``, the deadline or ``should_stop()``; checkpoint every
        ``checkpoint_every`` steps and at the end. Returns the last report row."""
        torch.manual_seed(self.train.seed + self.step)
        row: dict = {"step": self.step}
        t0 = time.monotonic()
        while self.step < self.train.steps:
            if should_stop() or (deadline_s is not None and time.monotonic() > deadline_s):
                break
            for group in self.opt.param_groups:
                group["lr"] = self.lr_at(self.step)
            self._expert_load.clear()
            loss = self.loss(self.sample_batch())
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for g in self.opt.param_groups for p in g["params"]], 1.0)
            self.opt.step()
            self._balance_experts()
            self.step += 1
            row = {"step": self.step, "loss": round(loss.item(), 4), "lr": self.lr_at(self.step - 1),
                   "tokens_per_s": round(self.step_tokens() / max(1e-9, time.monotonic() - t0), 1)}
            if self.last_mtp_loss is not None:
                row["mtp_loss"] = round(self.last_mtp_loss, 4)
            t0 = time.monotonic()
            report(row)
            if self.step % self.train.checkpoint_every == 0:
                self.save()
        self.save()
        return row

    def step_tokens(self) -> int:
        return self.train.batch_size * self.train.seq_len

    def _balance_experts(self) -> None:
        """Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded ones."""
        for layer_idx, load in self._expert_load.items():
            if self.train.only_mtp and layer_idx < self.cfg.num_hidden_layers:
                continue  # the model's own routing stays as it is
            bias = self.params.get(f"model.layers.{layer_idx}.mlp.gate.e_score_correction_bias")
            if bias is not None:
                bias.add_(self.train.bias_rate * torch.sign(load.mean() - load))

    def save(self) -> Path:
        """Weights (HF names, fp32) and the trainer state, each written atomically."""
        save_checkpoint(self.out, self.cfg, {k: v.contiguous() for k, v in self.hf_state_dict().items()})
        tmp = self.out / "trainer_state.pt.tmp"
        torch.save({"step": self.step, "optimizer": self.opt.state_dict(), "rng": self.rng.get_state(),
                    "train": asdict(self.train)}, tmp)
        tmp.replace(self.out / "trainer_state.pt")
        return self.out
