"""What regeneration needs besides the decoder (``headway.decode.batch_decoder`` answers in
process): repetition-loop stops (``repetition``) and the server-backed alternative, a retrying
client of OpenAI-compatible chat-completions servers (``server_client``) with many requests in
flight (``in_flight``). Inference only: it imports nothing from ``headway.train``."""
