"""Drafters as users name them: typed specs (:mod:`headway.drafters.specs`) and the one factory
that builds any of them (:func:`headway.drafters.build.build_drafter`), used by ``headway
generate``, ``headway eval``, the quickstart, ``scripts/compare.py`` and the Python API.

Layer: above ``heads``, ``decode`` and ``train`` (a retrieval corpus is read as chat data);
below ``eval``.
"""
