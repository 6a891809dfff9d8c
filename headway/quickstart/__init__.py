"""``headway quickstart``: regenerate data with the embedded target, train Medusa heads, export
them, and evaluate the ``lookup-medusa`` drafter (prompt lookup merged with confidence-gated
heads) that reads them back, in minutes on a CPU.

- :mod:`headway.quickstart.pipeline` — the stages, resumable
  (:func:`~headway.quickstart.pipeline.run_quickstart`);
- :mod:`headway.quickstart.plan` — every knob, for the embedded model and the tiny test target;
- :mod:`headway.quickstart.calibrate` — the heads' confidence gate, calibrated on held-out data;
- :mod:`headway.quickstart.tiny` — the tiny random target and data of ``--tiny``.

Layer: above ``eval``, ``drafters`` and ``train``; below ``cli``. The drafter it evaluates is an
ordinary :class:`~headway.drafters.specs.LookupMedusaSpec`, and the report prints the
``headway eval`` command that measures it again.
"""
