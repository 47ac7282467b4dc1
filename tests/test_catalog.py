"""The shipped SkyPilot catalog snapshot, read in one place (spotlight/catalog.py)."""

from __future__ import annotations

import csv

import pytest

from spotlight import catalog
from spotlight.config import load_config
from tests.conftest import REPO


def test_gpu_memory_is_the_catalogs_per_gpu_figure():
    assert catalog.gpu_memory_gib("T4:1") == 16.0
    assert catalog.gpu_memory_gib("A100-80GB:8") == 80.0, "by the row's AcceleratorName (p4de's GpuInfo says A100)"
    assert catalog.gpu_memory_gib("A100") == 40.0
    assert catalog.gpu_memory_gib("L4") == 22888 / 1024, "whole L4s: g6f's fractional rows are left out"
    assert catalog.gpu_memory_gib("L40S") == 45776 / 1024
    with pytest.raises(catalog.CatalogError, match="states no GPU memory for it"):
        catalog.gpu_memory_gib("TPU-V4")
    with pytest.raises(catalog.CatalogError, match="'Z100' is not in SkyPilot's catalog"):
        catalog.gpu_memory_gib("Z100")


def test_node_price_is_the_cheapest_type_with_its_median_zone_spot_price():
    price = catalog.node_price("L40S:1", "aws", "us-east-1")
    with open(catalog.CATALOG_DIR / "aws" / "vms.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["AcceleratorName"] == "L40S" and r["AcceleratorCount"] == "1.0"
                and r["Region"] == "us-east-1"]
    cheapest = min(rows, key=lambda r: float(r["Price"]))
    spot = sorted(float(r["SpotPrice"]) for r in rows if r["InstanceType"] == cheapest["InstanceType"])
    assert price.instance_type == cheapest["InstanceType"] == "g6e.xlarge"
    assert price.on_demand == float(cheapest["Price"])
    assert price.spot == (spot[len(spot) // 2] if len(spot) % 2 else (spot[len(spot) // 2 - 1] + spot[len(spot) // 2]) / 2)
    assert catalog.accelerator_price("L40S:1", "aws", "us-east-1", True) == ("g6e.xlarge", price.spot)


@pytest.mark.parametrize("config", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_names_only_accelerators_the_catalog_prices_and_sizes(config):
    cfg = load_config(config)  # validation refuses an unpriceable accelerator
    for kind in ("trainer", "explorer"):
        section = getattr(cfg.placement, kind)
        for spec in section.accelerators:
            assert catalog.priceable(spec, section.use_spot) is None
            assert catalog.gpu_memory_gib(spec) >= 16
