"""Chat corpora as headway reads them: the embedded sources (chitchat, ShareGPT), chat files
(JSONL, JSON, Parquet), a streaming JSON reader for truncated files, the sample types, and the
JSONL files headway writes. Shared by training, regeneration and the drafters that read a corpus
(retrieval, the quickstart's draft vocabulary); imports nothing from ``headway.train``."""
