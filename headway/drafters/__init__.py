"""Every runtime drafter, and the one place that decides and builds them.

- Drafters: prompt lookup (:mod:`~headway.drafters.lookup`), retrieval
  (:mod:`~headway.drafters.datastore`, built from a corpus by :mod:`~headway.drafters.retrieval`),
  merged/first-of (:mod:`~headway.drafters.merged`), Medusa
  (:mod:`~headway.drafters.medusa_drafter`), confidence-gated Medusa
  (:mod:`~headway.drafters.confident_drafter`), EAGLE-1/2 (:mod:`~headway.drafters.eagle_drafter`),
  EAGLE-3 (:mod:`~headway.drafters.eagle3_drafter`), prompt lookup + Medusa
  (:mod:`~headway.drafters.lookup_medusa`), and the test drafters (:mod:`~headway.drafters.oracle`).
- Deciding and building: typed specs (:mod:`~headway.drafters.specs`), the resolver from what a
  user named (:func:`~headway.drafters.resolve.resolve_drafter`) and the one factory
  (:func:`~headway.drafters.build.build_drafter`), used by ``headway generate``, ``headway eval``,
  the quickstart, ``scripts/compare.py`` and the Python API.

Layer: above ``decode`` (the loop, tree, verify, caches) and ``heads`` (the trainable modules and
engine formats), below ``generation`` and ``train``; never imports ``train``.
"""
