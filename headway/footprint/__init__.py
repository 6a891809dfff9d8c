"""Plan a training run before starting it: memory per process, feature-cache disk and
regeneration time, from the recipe and the target's config alone (``headway plan``).

- :mod:`~headway.footprint.sizes`: exact parameter counts of the target and the drafter, built
  on the meta device;
- :mod:`~headway.footprint.activations`: one micro-batch's activation peak, term by term;
- :mod:`~headway.footprint.memory`: weights, drafter state, DDP buckets and activations per
  process (replicated today, or FSDP-sharded);
- :mod:`~headway.footprint.disk`: an offline feature cache's bytes per token, regeneration time;
- :mod:`~headway.footprint.run_plan` and :mod:`~headway.footprint.tables`: the whole plan and
  its table / JSON.
"""

from headway.footprint.run_plan import RunPlan, build_plan
from headway.footprint.tables import plan_json, plan_table

__all__ = ["RunPlan", "build_plan", "plan_json", "plan_table"]
