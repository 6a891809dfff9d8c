"""The batched, continuous generation engine that answers many prompts at once (regeneration of
self-distillation data): ragged KV cache, prompt-lookup lookahead verified in the same forward,
grouped-query attention read once per key/value head, repetition-loop stops. Inference only: it
imports nothing from ``headway.train``."""
