"""DeepSeek-V2/V3 architecture: config, MLA, MoE, latent KV pool, loading, tokenizer, sampling.

Single device, no Ray, no scheduling. Import the submodules (``model.checkpoint``,
``model.model``, ...); the package itself imports nothing, so the admin commands that only read
``model.default`` or ``model.config`` do not pay for importing torch."""
