"""The batched, continuous generation engine that answers many prompts at once (regeneration of
self-distillation data): ragged KV cache, prompt-lookup lookahead verified in the same forward,
grouped-query attention read once per key/value head, repetition-loop stops; and the
server-backed alternative: a retrying client of OpenAI-compatible chat-completions servers
(``server_client``) with many requests in flight (``in_flight``). Inference only: it imports
nothing from ``headway.train``."""
