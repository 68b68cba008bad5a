"""The prompt cache's unit: tokens per unit (the engine, the ingress and the stores share it)."""

UNIT_TOKENS = 64
