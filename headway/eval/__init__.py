"""Evaluation: how much a drafter speeds up decoding, and how accurate its heads are.

- :mod:`headway.eval.acceptance` — tau, per-depth and per-position acceptance from traces;
- :mod:`headway.eval.gates` — a shipped drafter's per-position acceptance gates (``gates.json``);
- :mod:`headway.eval.speed` — the drafter and plain decoding on the same prompts, interleaved;
- :mod:`headway.eval.report` / :mod:`headway.eval.plots` — ``report.json``, ``summary.md``, PNGs;
- :mod:`headway.eval.run` — ``headway eval`` end to end (:func:`~headway.eval.run.evaluate`);

``headway eval --heads-only`` (per-head accuracy on held-out data through the training method's
own metrics, without decoding) replays a training method, so it lives in training:
:mod:`headway.train.heads_accuracy`. Drafters are built by :mod:`headway.drafters`; the quickstart
lives in :mod:`headway.quickstart`.

Layer: below ``quickstart`` and ``cli``; imports nothing from ``train``.
"""
