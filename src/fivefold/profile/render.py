"""Terminal output of `fivefold profile` (rich; imported by the CLI only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fivefold.profile.run import Profile


def profile_with_progress(nproc: int, quick: bool, show: bool) -> Profile:
    """run_profile with a transient progress bar on stderr (none when `show` is False)."""
    import torch
    from rich.console import Console
    from rich.progress import Progress

    from fivefold.profile.run import run_profile

    total = profile_steps(nproc, quick, gpu=torch.cuda.is_available())
    with Progress(console=Console(stderr=True, highlight=False), transient=True, disable=not show) as progress:
        task = progress.add_task("profiling", total=total)

        def on_step(kind: str, item: object) -> None:
            progress.update(task, advance=1, description=describe_step(kind, item))

        return run_profile(nproc, quick, on_step=on_step)


def profile_renderables(profile: Profile, out: str) -> list:
    """The best GEMM rate per dtype, memory bandwidth, each collective's bandwidth and latency."""
    from rich.table import Table

    from fivefold.profile.collectives import COLLECTIVES

    table = Table(title=f"fivefold profile: {profile.device}, {profile.processes} processes", box=None)
    for column in ("what", "measured"):
        table.add_column(column)
    for dtype, flops in profile.peak_flops().items():
        table.add_row(f"best GEMM {dtype}", f"{flops / 1e12:.3g} TFLOP/s")
    table.add_row("memory bandwidth", f"{profile.memory_bandwidth / 1e9:.3g} GB/s")
    host = profile.host_costs
    if host is not None and host.serving:  # profile/serving.py
        table.add_row("serving engine host", f"{host.serve_step * 1e6:.0f} us/step + {host.serve_request * 1e6:.0f} "
                      f"us/request + {host.serve_layer * 1e6:.0f} us/layer (+{host.serve_attention_group * 1e6:.0f} "
                      f"us per extra attention call); worker queues {host.serve_worker_step * 1e6:.0f} us/step; "
                      f"{host.serve_wake * 1e6:.0f} us to wake")
    for collective in COLLECTIVES:
        points = [p for p in profile.collectives if p.collective == collective and p.ranks == profile.processes]
        if points:
            table.add_row(f"{collective}", f"{points[-1].bus_bandwidth / 1e9:.3g} GB/s bus at "
                          f"{points[-1].message_bytes >> 20} MiB, {points[0].seconds * 1e6:.0f} us at "
                          f"{points[0].message_bytes >> 10} KiB")
    return [table, f"wrote {out}; use it with --cluster {out}"]


def profile_steps(nproc: int, quick: bool, gpu: bool) -> int:
    """How many measurements `run_profile` reports through on_step (the progress bar's total)."""
    from fivefold.profile.collectives import COLLECTIVES, PAIR_COLLECTIVES, measures_pairs, message_sizes
    from fivefold.profile.kernels import gemm_shapes

    total = (3 if gpu else 2) * len(gemm_shapes(quick, cpu=not gpu)) + 1
    if nproc > 1:
        total += len(COLLECTIVES) * len(message_sizes(quick))
    if measures_pairs(nproc):
        total += len(PAIR_COLLECTIVES) * len(message_sizes(quick))
    return total


def describe_step(kind: str, item: object) -> str:
    """The progress bar's line for one measurement."""
    if kind == "gemm":
        return f"GEMM {item.m}x{item.n}x{item.k} {item.dtype}"  # type: ignore[attr-defined]
    if kind == "memory":
        return "memory bandwidth"
    return f"{item.collective} {item.message_bytes} B over {item.ranks} ranks"  # type: ignore[attr-defined]
