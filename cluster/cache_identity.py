"""One model's cache identity: what its prompt-cache units are keyed by, shared by the ingress
(which hashes a prompt's units to plan it) and the replica (which loads and stores them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cachedir.hashing import Namespace, read_secret
from cluster.request import cache_namespace
from model.config import load_config
from model.weights_id import stored_mtp_layers, tensor_names, weights_digest, weights_form

__all__ = ["CacheIdentity"]


@dataclass(frozen=True, slots=True)
class CacheIdentity:
    """The checkpoint, the KV's dtype, how the weights are held (int8 and fp8 weights compute
    other KV), whether the replicas draft with the checkpoint's MTP layers (their latents ride in
    the units) and the cluster's cache secret (a file, read where the namespace is made: secrets
    never travel in configs)."""

    checkpoint: str
    dtype: str = "float32"
    device: str = "cpu"
    cpu_weights: str = "fp32"
    fp8_weights: str = "auto"
    secret_file: str | None = None
    speculative: bool = False

    def namespace(self, mcfg=None, secret: bytes | None = None) -> Namespace:
        """The cache namespace (``mcfg``: the checkpoint's config, ``secret``: the secret file's
        bytes, when the caller has read them already)."""
        ckpt = Path(self.checkpoint)
        form = weights_form(ckpt, self.device, self.cpu_weights, self.fp8_weights)
        secret = read_secret(self.secret_file) if secret is None else secret
        mcfg = mcfg or load_config(ckpt)
        drafts = stored_mtp_layers(mcfg, tensor_names(ckpt)) if self.speculative else 0
        return cache_namespace(mcfg, weights_digest(ckpt), self.dtype, secret, form, drafts)
