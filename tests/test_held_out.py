"""The held-out evaluation reads at most ``data.eval_max_samples`` samples of the fixed split."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from headway.config import load_config
from headway.errors import ConfigError
from headway.run_config import RunConfig
from headway.train.held_out import first_samples


def test_first_samples_keeps_the_head_of_the_split() -> None:
    dataset = TensorDataset(torch.arange(10))
    capped = first_samples(dataset, 3)
    assert [int(capped[i][0]) for i in range(len(capped))] == [0, 1, 2]  # type: ignore[arg-type]
    assert first_samples(dataset, None) is dataset
    assert first_samples(dataset, 50) is dataset


def test_the_cap_is_validated_and_the_cpu_recipes_set_it() -> None:
    with pytest.raises(ConfigError, match="eval_max_samples=0 must be >= 1"):
        load_config(RunConfig, None, ["data.eval_max_samples=0"])
    for name, cap in (("medusa1", 16), ("eagle1", 32), ("eagle3", 32)):
        config = load_config(RunConfig, f"configs/{name}-smollm2.yaml", [])
        assert config.data.eval_max_samples == cap
        assert config.train.mixed_precision == "auto"
