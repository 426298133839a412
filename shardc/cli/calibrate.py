"""``shardc calibrate``: measure the devices at hand into a Cluster JSON that
``shardc plan --cluster`` and ``Cluster.from_json`` read."""

from __future__ import annotations

import json
import sys
import time

from shardc.cli.common import axes_for, device_mesh
from shardc.util.devices import force_cpu_devices

__all__ = ["cmd_calibrate"]


def cmd_calibrate(args) -> None:
    force_cpu_devices(args.devices)
    import shardc
    from shardc.cost.calibrate import CalibrateOptions

    names = axes_for("calibrate", args.mesh, args.axes)
    mesh = device_mesh(args.mesh, names)
    given = {"sizes": tuple(args.sizes) if args.sizes else None, "reps": args.reps,
             "chain": args.chain, "matmul_size": args.matmul_size}
    try:
        options = CalibrateOptions(**{k: v for k, v in given.items() if v is not None})
    except ValueError as exc:
        sys.exit(f"shardc calibrate: {exc}")
    t0 = time.perf_counter()
    cluster, calibration = shardc.Cluster.calibrate(mesh, options)
    print(f"calibrated {mesh.size} {mesh.devices.flat[0].platform} devices in "
          f"{time.perf_counter() - t0:.1f} s")
    print(calibration.report())
    with open(args.out, "w") as f:
        json.dump(cluster.to_json(), f, indent=1)
        f.write("\n")
    print(f"cluster saved to {args.out} (shardc plan --cluster {args.out})")
    if args.report:
        with open(args.report, "w") as f:
            json.dump(calibration.to_json(), f, indent=1)
        print(f"fit saved to {args.report}")
