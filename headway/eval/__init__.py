"""Evaluation: how much a drafter speeds up decoding, and how accurate its heads are.

- :mod:`headway.eval.acceptance` — tau and per-depth acceptance from accept-length traces;
- :mod:`headway.eval.speed` — the drafter and plain decoding on the same prompts, interleaved;
- :mod:`headway.eval.report` / :mod:`headway.eval.plots` — ``report.json``, ``summary.md``, PNGs;
- :mod:`headway.eval.run` — ``headway eval`` end to end (:func:`~headway.eval.run.evaluate`);
- :mod:`headway.eval.heads_only` — ``headway eval --heads-only``: per-head accuracy on held-out
  data through the training method's own metrics, without decoding;

Drafters are built by :mod:`headway.drafters`; the quickstart lives in :mod:`headway.quickstart`.

Layer: above ``train`` (it reuses training methods and data), below ``cli``.
"""
