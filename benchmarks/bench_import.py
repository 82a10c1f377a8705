"""Cost of the setgrpo_verl verl plugin at ``import verl``: time and peak RSS, plugin on vs off.

verl imports every ``verl.plugins`` entry point at ``import verl`` in its driver, its TaskRunner and every Ray
worker, so whatever the plugin imports is paid by each of those processes. This runs ``import verl`` in fresh
subprocesses, alternating ``VERL_USE_EXTERNAL_PLUGINS=auto`` (plugin on) and ``=none`` (off) so that load from
other processes hits both alike, and prints the medians, their differences and ratios. Each child reports the
wall time of the import itself and its peak RSS (``ru_maxrss``). Target: at most +1 s and +50 MB.

Run: ``python benchmarks/bench_import.py [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
import verl
t1 = time.perf_counter()
print(json.dumps({"seconds": t1 - t0, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "plugin": "setgrpo_verl.integration.plugin" in sys.modules}))
"""


def _measure(policy: str) -> dict:
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": policy}
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"import verl failed with VERL_USE_EXTERNAL_PLUGINS={policy}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="measurements per setting (alternating)")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"auto": [], "none": []}
    for _ in range(args.repeats):
        for policy in ("none", "auto"):
            runs[policy].append(_measure(policy))
    if not all(r["plugin"] for r in runs["auto"]) or any(r["plugin"] for r in runs["none"]):
        raise RuntimeError("the plugin was not loaded with VERL_USE_EXTERNAL_PLUGINS=auto (is setgrpo-verl installed?)")
    med = {p: {k: statistics.median(r[k] for r in rs) for k in ("seconds", "rss_mb")} for p, rs in runs.items()}
    on, off = med["auto"], med["none"]
    print(f"import verl, median of {args.repeats} alternating runs each")
    print(f"{'':18}{'time (s)':>10}{'peak RSS (MB)':>16}")
    print(f"{'plugin off (none)':18}{off['seconds']:>10.2f}{off['rss_mb']:>16.0f}")
    print(f"{'plugin on (auto)':18}{on['seconds']:>10.2f}{on['rss_mb']:>16.0f}")
    print(f"{'on - off':18}{on['seconds'] - off['seconds']:>+10.2f}{on['rss_mb'] - off['rss_mb']:>+16.0f}")
    print(f"{'on / off':18}{on['seconds'] / off['seconds']:>10.3f}{on['rss_mb'] / off['rss_mb']:>16.3f}")
    print("target: on - off <= +1.00 s and <= +50 MB")


if __name__ == "__main__":
    main()
