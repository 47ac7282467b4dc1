"""The shipped SkyPilot catalog snapshot (``sky/catalog/v8``): accelerator names, node prices, GPU memory.

The only module that reads the catalog's CSVs: config validation (which accelerators exist, which
can be priced), the memory plan (GPU memory), the forecast (a node's on-demand and spot price) and
the cost ledger (the price of the instance a worker got) all ask here, so they agree. Stdlib only:
it sits below everything (``sky/catalog/README.md`` says which rows are kept and where they come from).
"""

from __future__ import annotations

import ast
import csv
import statistics
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

CATALOG_DIR = Path(__file__).resolve().parent.parent / "sky" / "catalog" / "v8"
ACCELERATORS_CSV = "common/accelerators.csv"
#: clouds whose rows carry per-GPU memory (``GpuInfo``); GCP's GPU rows have none
MEMORY_CLOUDS = ("aws", "lambda")


class CatalogError(ValueError):
    """Something the catalog does not have (an accelerator, a cloud, a price); the message names it."""


class PriceError(CatalogError):
    """An instance or accelerator the catalog cannot price."""


# -- the files ----------------------------------------------------------------------------------------
@lru_cache(maxsize=16)
def vm_rows(cloud: str, catalog_dir: Path = CATALOG_DIR) -> tuple[dict[str, str], ...]:
    """Every row of one cloud's ``vms.csv`` (column order differs per cloud: read by name)."""
    path = Path(catalog_dir) / cloud.lower() / "vms.csv"
    if not path.is_file():
        clouds = sorted(p.name for p in Path(catalog_dir).iterdir() if (p / "vms.csv").is_file())
        raise PriceError(f"cloud {cloud!r} has no price catalog {path}; clouds: {', '.join(clouds)}")
    with open(path, newline="") as f:
        return tuple(csv.DictReader(f))


@lru_cache(maxsize=4)
def accelerator_names(catalog_dir: Path = CATALOG_DIR) -> dict[str, str]:
    """SkyPilot's accelerator names, by lowercase name (``common/accelerators.csv``, the whole upstream file)."""
    with open(Path(catalog_dir) / ACCELERATORS_CSV, newline="") as f:
        return {row["AcceleratorName"].lower(): row["AcceleratorName"] for row in csv.DictReader(f)}


def parse_accelerator_spec(spec: str, catalog_dir: Path = CATALOG_DIR) -> tuple[str, int]:
    """``L4:1`` -> ("L4", 1) with SkyPilot's spelling of the name; a bare name is one GPU, as in SkyPilot."""
    name, sep, count = str(spec).partition(":")
    count = count if sep else "1"
    if not name or not count.isdigit() or int(count) < 1:
        raise CatalogError(f"accelerator {spec!r}: expected NAME or NAME:COUNT, e.g. L4:1 or A100:8")
    known = accelerator_names(catalog_dir)
    if name.lower() not in known:
        close = sorted(a for a in known.values() if a.lower().startswith(name.lower()[:2]))
        raise CatalogError(f"accelerator {name!r} is not in SkyPilot's catalog (sky/catalog/v8/{ACCELERATORS_CSV})"
                           + (f"; did you mean one of {', '.join(close)}?" if close else ""))
    return known[name.lower()], int(count)


# -- GPU memory -------------------------------------------------------------------------------------
@lru_cache(maxsize=4)
def _gpu_memory_mib(catalog_dir: Path = CATALOG_DIR) -> dict[str, int]:
    """MiB per GPU by accelerator name: ``GpuInfo.Gpus[].MemoryInfo.SizeInMiB`` of the AWS and Lambda rows
    with whole GPUs (the fractional L4 rows of g6f are left out), keyed by the row's ``AcceleratorName``
    (AWS's p4de rows say "A100" inside GpuInfo but are A100-80GB). Where rows disagree the smallest wins."""
    out: dict[str, int] = {}
    for cloud in MEMORY_CLOUDS:
        for row in vm_rows(cloud, catalog_dir):
            name, count, info = row.get("AcceleratorName"), row.get("AcceleratorCount"), row.get("GpuInfo")
            if not name or not count or float(count) < 1 or not info:
                continue
            for gpu in ast.literal_eval(info)["Gpus"]:
                mib = int(gpu["MemoryInfo"]["SizeInMiB"])
                out[name] = min(out.get(name, mib), mib)
    return out


def gpu_memory_gib(accelerator: str, catalog_dir: Path = CATALOG_DIR) -> float:
    """GiB of memory per GPU of an accelerator (``A100-80GB`` or ``A100-80GB:8``), as the catalog states it
    (AWS reports what a process can allocate: an A10G is 22,888 MiB, not 24 GiB)."""
    name, _ = parse_accelerator_spec(accelerator, catalog_dir)
    memory = _gpu_memory_mib(catalog_dir)
    if name not in memory:
        raise CatalogError(f"accelerator {name}: the shipped catalog states no GPU memory for it (no AWS or "
                           f"Lambda row); known: {', '.join(sorted(memory))}")
    return memory[name] / 1024


# -- prices ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Price:
    """$/h of one node of ``accelerator`` in a region: on-demand, and spot (median over the zones)."""

    accelerator: str
    cloud: str
    region: str
    instance_type: str
    on_demand: float
    spot: float
    spot_low: float
    spot_high: float
    spot_zones: int

    def describe(self) -> str:
        return (f"{self.accelerator} {self.cloud} {self.region} {self.instance_type}: on-demand "
                f"${self.on_demand:.4f}/h, spot ${self.spot:.4f}/h (median of {self.spot_zones} zone rows, "
                f"${self.spot_low:.4f}-{self.spot_high:.4f})")


def node_price(accelerator: str, cloud: str, region: str, catalog_dir: Path = CATALOG_DIR) -> Price:
    """Prices from the catalog's rows for this accelerator and count in this region.

    The node is the instance type with the lowest on-demand price there. Its on-demand price is
    that row's. Its spot price is the median ``SpotPrice`` of that type over the region's zones.
    AWS names zones per account (us-east-1c is not the same zone as the catalog's use1-az1), so
    a trace's zone cannot pick a catalog row. The median stands for "some zone of the region".
    """
    name, gpus = parse_accelerator_spec(accelerator, catalog_dir)
    if cloud.lower() == "gcp":
        raise PriceError("cloud 'gcp': its catalog prices GPUs apart from host VMs, which this price "
                         "does not combine; use aws, azure or lambda")
    path = Path(catalog_dir) / cloud.lower() / "vms.csv"
    rows = [r for r in vm_rows(cloud, catalog_dir) if r["AcceleratorName"] == name and r["AcceleratorCount"]
            and float(r["AcceleratorCount"]) == gpus and r["Price"]]
    here = [r for r in rows if r["Region"] == region]
    if not here:
        regions = sorted({r["Region"] for r in rows})
        raise PriceError(f"{path}: no on-demand row for {name}:{gpus} in region {region!r}"
                         + (f"; regions with one: {', '.join(regions)}" if regions else ""))
    node = min(here, key=lambda r: (float(r["Price"]), r["InstanceType"]))
    spot = [float(r["SpotPrice"]) for r in here if r["InstanceType"] == node["InstanceType"] and r["SpotPrice"]]
    if not spot:
        raise PriceError(f"{path}: {node['InstanceType']} ({name}:{gpus}) has no spot price in {region}")
    return Price(accelerator=f"{name}:{gpus}", cloud=cloud.lower(), region=region,
                 instance_type=node["InstanceType"], on_demand=float(node["Price"]), spot=statistics.median(spot),
                 spot_low=min(spot), spot_high=max(spot), spot_zones=len(spot))


def instance_price(cloud: str, instance_type: str, region: str, zone: str | None, use_spot: bool,
                   catalog_dir: Path = CATALOG_DIR) -> float:
    """$/h of one instance: on-demand from its region's row; spot from its zone's row (SkyPilot names AWS
    zones by zone ID, e.g. use1-az4, as its job records do), else the region's median."""
    rows = [r for r in vm_rows(cloud, catalog_dir) if r["InstanceType"] == instance_type and r["Region"] == region]
    if not rows:
        raise PriceError(f"the {cloud} catalog has no instance {instance_type!r} in region {region!r}")
    if not use_spot:
        return float(rows[0]["Price"])
    spot = [r for r in rows if r["SpotPrice"]]
    here = [r for r in spot if zone and r["AvailabilityZone"] == zone]
    if here:
        return float(here[0]["SpotPrice"])
    if not spot:
        raise PriceError(f"the {cloud} catalog has no spot price for {instance_type} in {region}")
    return statistics.median(float(r["SpotPrice"]) for r in spot)


def accelerator_price(accelerator: str, cloud: str, region: str, use_spot: bool,
                      catalog_dir: Path = CATALOG_DIR) -> tuple[str, float]:
    """(instance type, $/h) of the cheapest node with this accelerator in a region: when only the
    accelerator a worker got is known."""
    price = node_price(accelerator, cloud, region, catalog_dir)
    return price.instance_type, price.spot if use_spot else price.on_demand


def priceable(accelerator: str, use_spot: bool, catalog_dir: Path = CATALOG_DIR) -> str | None:
    """Why no cloud of the catalog can price this accelerator (on-demand, and spot when ``use_spot``), or
    None when some can: a placement naming it would otherwise be billed $0."""
    name, gpus = parse_accelerator_spec(accelerator, catalog_dir)
    clouds = sorted(p.name for p in Path(catalog_dir).iterdir() if (p / "vms.csv").is_file())
    rows = [r for cloud in clouds for r in vm_rows(cloud, catalog_dir)
            if r.get("AcceleratorName") == name and r.get("AcceleratorCount")
            and float(r["AcceleratorCount"]) == gpus]
    if not any(r.get("Price") for r in rows):
        return f"the shipped catalog has no on-demand price for {name}:{gpus} on {', '.join(clouds)}"
    if use_spot and not any(r.get("SpotPrice") for r in rows):
        return f"the shipped catalog has no spot price for {name}:{gpus} (set use_spot: false, or drop it)"
    return None
