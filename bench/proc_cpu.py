"""CPU seconds each Ray Serve process of our server spends while a command runs (a diagnostic).

    python -m bench.proc_cpu -- python -m bench.serving --workloads burst ...

Matches the proxy, the ingress replica and model replicas by process title (ray::ProxyActor,
ray::ServeReplica:orchard:Ingress, ray::ServeReplica:<model>:ModelServer) and engine processes (EngineChild); prints one line,
`proc_cpu: wall W s; ProxyActor X s, Ingress Y s, ...`, after the command's own output.
Needs psutil: the GPU bundle has it; on the dev machine `pip install psutil` (not a dependency of ours).
"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

ROLES = ("ProxyActor", "ServeController", "Ingress", "ModelServer")
# A model replica's engine process (engine_process: true) is a child, `python -m engine.engine_child FD`.
ENGINE_CHILD = "engine.engine_child"


def serve_processes() -> dict[str, list[psutil.Process]]:
    found: dict[str, list[psutil.Process]] = {}
    for proc in psutil.process_iter(["name", "cmdline"]):
        title = " ".join(proc.info["cmdline"] or []) or (proc.info["name"] or "")
        if ENGINE_CHILD in title:
            found.setdefault("EngineChild", []).append(proc)
        if not title.startswith("ray::"):
            continue
        for role in ROLES:
            if role in title:
                found.setdefault(role, []).append(proc)
    return found


def cpu_seconds(procs: dict[str, list[psutil.Process]]) -> dict[str, float]:
    totals = {}
    for role, members in procs.items():
        total = 0.0
        for proc in members:
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.Error:  # gone since: its CPU is lost to the count
                pass
        totals[role] = total
    return totals


def main(argv: list[str]) -> int:
    command = argv[1:] if argv and argv[0] == "--" else argv
    if not command:
        print(__doc__, file=sys.stderr)
        return 2
    procs = serve_processes()
    before, started = cpu_seconds(procs), time.monotonic()
    code = subprocess.call(command)
    after, wall = cpu_seconds(procs), time.monotonic() - started
    used = ", ".join(f"{role} {after[role] - before[role]:.2f} s" for role in sorted(before))
    print(f"proc_cpu: wall {wall:.1f} s; {used or 'no Serve processes found'}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
