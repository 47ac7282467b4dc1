"""What each part of a run costs per hour or per request in the forecast: workers from the config's
placement and the shipped SkyPilot catalog (:mod:`spotlight.catalog`), the controller VM, S3 requests.

The forecast keeps its own prices (the live ledger, :mod:`spotlight.cost`, prices what a worker got), so
a change here never moves a real run's cost entries.

* **Workers.** A placement section lists ``any_of`` accelerators; SkyPilot's optimizer, minimising
  cost with no time estimate, takes the cheapest per hour. Here: the cheapest entry the catalog prices
  in the trace's region, at the on-demand price, or at the spot price (median of the region's zone
  rows: AWS names zones per account, so a trace's zone cannot pick a row) when the section is spot.
* **Controller.** ``sky/controller.yaml`` asks for ``cpus: 2+, memory: 4+`` on demand: on AWS, SkyPilot's
  default CPU families give c6i.large. The shipped catalog keeps GPU rows only, so its price is
  AWS's published on-demand rate unless the catalog has the row.
* **S3 requests.** S3 Standard, us-east-1 and us-west-2 (https://aws.amazon.com/s3/pricing/): PUT,
  COPY, POST, LIST $0.005 per 1,000; GET, HEAD and other requests $0.0004 per 1,000; DELETE free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spotlight.catalog import CATALOG_DIR, CatalogError, instance_price, node_price, parse_accelerator_spec, vm_rows
from spotlight.forecast.errors import ForecastError

S3_PUT_CLASS_USD = 0.005 / 1000
S3_GET_CLASS_USD = 0.0004 / 1000
CONTROLLER_INSTANCE = {"aws": "c6i.large"}  # 2 vCPU, 4 GiB: the cheapest of SkyPilot's AWS default families
#: AWS on-demand, Linux (https://aws.amazon.com/ec2/pricing/on-demand/, read 2026-12): when the catalog has no row
PUBLISHED_CONTROLLER_USD_PER_HOUR = {("aws", "us-east-1"): 0.085, ("aws", "us-west-2"): 0.085}


@dataclass(frozen=True)
class Offer:
    """One worker kind's instance in a region, at the price it runs at."""

    kind: str  # trainer, explorer, controller
    accelerator: str | None
    instance_type: str
    use_spot: bool
    usd_per_hour: float
    region: str
    source: str
    dropped: tuple[str, ...] = ()  # any_of entries this region cannot price, and why

    def describe(self) -> str:
        market = "spot" if self.use_spot else "on-demand"
        what = f"{self.accelerator} " if self.accelerator else ""
        dropped = f"; not priceable here: {', '.join(self.dropped)}" if self.dropped else ""
        return f"{self.kind}: {what}{self.instance_type} {market} ${self.usd_per_hour:.4f}/h in {self.region} " \
               f"({self.source}{dropped})"


def _on_demand(accelerator: str, cloud: str, region: str, catalog_dir: Path) -> tuple[str, str, float]:
    """The cheapest on-demand node of this accelerator and count in a region (spot rows not needed):
    (NAME:COUNT, instance type, $/h)."""
    name, gpus = parse_accelerator_spec(accelerator, catalog_dir)
    rows = [r for r in vm_rows(cloud, catalog_dir) if r["AcceleratorName"] == name and r["AcceleratorCount"]
            and float(r["AcceleratorCount"]) == gpus and r["Price"] and r["Region"] == region]
    if not rows:
        raise CatalogError(f"no on-demand row for {name}:{gpus} in {cloud} {region}")
    row = min(rows, key=lambda r: (float(r["Price"]), r["InstanceType"]))
    return f"{name}:{gpus}", row["InstanceType"], float(row["Price"])


def worker_offer(kind: str, accelerators: tuple[str, ...] | list[str], use_spot: bool, cloud: str, region: str,
                 catalog_dir: Path = CATALOG_DIR) -> Offer:
    """The cheapest ``any_of`` entry at the market it runs on; an error naming them all if none is priceable."""
    priced, dropped = [], []
    for accelerator in accelerators:
        try:
            if use_spot:
                price = node_price(accelerator, cloud, region, catalog_dir)
                priced.append((price.spot, price.accelerator, price.instance_type,
                               f"catalog: median spot of {price.spot_zones} zone rows"))
            else:
                name, instance, usd = _on_demand(accelerator, cloud, region, catalog_dir)
                priced.append((usd, name, instance, "catalog: on-demand row"))
        except CatalogError:
            dropped.append(accelerator)
    if not priced:
        raise ForecastError(f"placement.{kind}: none of {', '.join(accelerators)} has a "
                            f"{'spot' if use_spot else 'on-demand'} price in {cloud} {region} in the shipped catalog")
    usd, accelerator, instance, source = min(priced)
    return Offer(kind, accelerator, instance, use_spot, usd, region, source, tuple(dropped))


def controller_offer(cloud: str, region: str, catalog_dir: Path = CATALOG_DIR) -> Offer:
    """The controller VM, on demand: the catalog's row when it has one, else the published price."""
    instance = CONTROLLER_INSTANCE.get(cloud)
    if instance is None:
        raise ForecastError(f"cloud {cloud!r}: the forecast knows the controller's instance on "
                            f"{', '.join(CONTROLLER_INSTANCE)} only")
    try:
        return Offer("controller", None, instance, False, instance_price(cloud, instance, region, None, False,
                                                                         catalog_dir), region, "catalog row")
    except CatalogError:
        published = PUBLISHED_CONTROLLER_USD_PER_HOUR.get((cloud, region))
        if published is None:
            raise ForecastError(f"no price for the controller's {instance} in {cloud} {region}: the shipped "
                                "catalog has no row and no published price is recorded") from None
        return Offer("controller", None, instance, False, published, region,
                     "AWS published on-demand price; the shipped catalog has GPU rows only")
