"""SkyPilot's own records, made by SkyPilot's own code (never written by hand): the resources string of a
launched cluster (``resources_utils.get_readable_resources_repr`` of a real ``CloudVmRayResourceHandle``,
what ``sky jobs queue`` and ``sky status`` show), offline.

SkyPilot reads instance facts (vCPUs, memory) from its catalog under ``~/.sky/catalogs``, fixed when it
is first imported; ``seed_catalog`` puts the shipped snapshot there in a private home. In a process whose
HOME is private (the emulated cluster runs in the test's ``spotlight run``), ``resources_string`` runs
in-process; elsewhere ``resources_strings`` runs it in a subprocess with a private home.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CATALOG = REPO / "sky" / "catalog" / "v8"


def seed_catalog(home: Path) -> None:
    """The shipped catalog snapshot where SkyPilot looks for it under ``home`` (nothing is downloaded)."""
    target = Path(home) / ".sky" / "catalogs" / "v8"
    if not target.is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(CATALOG, target)


def resources_string(cloud: str, region: str, zone: str | None, instance_type: str, accelerators: str | None,
                     use_spot: bool, nodes: int = 1, disk_size: int = 100) -> str:
    """``cluster_resources_full`` of a cluster of ``nodes`` such instances, as SkyPilot formats it."""
    import sky
    from sky.backends.cloud_vm_ray_backend import CloudVmRayResourceHandle
    from sky.utils.resources_utils import get_readable_resources_repr

    infra = "/".join(x for x in (cloud.lower(), region, zone) if x)
    resources = sky.Resources(infra=infra, instance_type=instance_type, accelerators=accelerators,
                              use_spot=use_spot, disk_size=disk_size)
    handle = CloudVmRayResourceHandle(cluster_name="c", cluster_name_on_cloud="c-0", cluster_yaml=None,
                                      launched_nodes=nodes, launched_resources=resources)
    return get_readable_resources_repr(handle, simplified_only=False)[1]


def resources_strings(specs: list[dict[str, Any]], timeout: float = 300) -> list[str]:
    """``resources_string(**spec)`` for each spec, in a subprocess with a private SkyPilot home."""
    with tempfile.TemporaryDirectory(prefix="spotlight-sky-records-") as home:
        seed_catalog(Path(home))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SKYPILOT_API"))}
        env.update(HOME=home, SKY_RUNTIME_DIR=home, SKYPILOT_DISABLE_USAGE_COLLECTION="1",
                   PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
        code = ("import json, sys; from tests.sky_records import resources_string; "
                "print(json.dumps([resources_string(**s) for s in json.loads(sys.argv[1])]))")
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(specs)], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"SkyPilot's formatting failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])
