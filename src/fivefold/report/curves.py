"""RUN/report-curves.png (one run) and RUN/report-compare.png (`--compare`: runs overlaid): loss with
eval_loss, learning rate, gradient norm and tokens/s over the steps, one panel each, from the runs' metrics
files (report/training.py). A run's later launches (resumes, requeues) start at a dotted line."""

from __future__ import annotations

from pathlib import Path

from fivefold.report.training import TrainingRun, TrainingSummary, load_training_run, summarize_training

CURVES = "report-curves.png"
COMPARE = "report-compare.png"
PANELS = (("loss", "loss (eval_loss: circles)"), ("lr", "learning rate"), ("grad_norm", "gradient norm"),
          ("tokens_per_s", "tokens/s"))


def write_curves_png(runs: list[TrainingRun], path: Path, resumes: list[int] | None = None) -> Path:
    """The four panels of `runs` (the first run's colour is the first of matplotlib's cycle); `resumes`: steps
    where the one run's later launches began."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for number, run in enumerate(runs):
        color = colors[number % len(colors)]
        for panel, (name, title) in zip(axes.flat, PANELS):
            points = run.values(name)
            if points:
                panel.plot(*zip(*points), color=color, linewidth=1.2, label=run.label)
            if name == "loss":
                evals = run.values("eval_loss")
                if evals:
                    panel.plot(*zip(*evals), "o--", color=color, markersize=4, linewidth=0.8)
            panel.set_title(title, fontsize=10)
    for panel in axes.flat:
        for step in resumes or []:
            panel.axvline(step, color="grey", linestyle=":", linewidth=0.8)
        panel.grid(alpha=0.3)
    if all(v > 0 for run in runs for _, v in run.values("lr")):  # warmup and decay span decades
        axes[0, 1].set_yscale("log")
    for panel in axes[1]:
        panel.set_xlabel("step")
        panel.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(runs) > 1:
        axes[0, 0].legend(fontsize=8)
    figure.suptitle(" vs ".join(run.label for run in runs) if len(runs) > 1 else str(runs[0].folder), fontsize=11)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def report_training(path: str | Path, compare: list[str] | None = None
                    ) -> tuple[TrainingSummary, list[TrainingSummary]]:
    """The training summary of the run at `path` with RUN/report-curves.png, and with `compare` the other runs'
    summaries and RUN/report-compare.png."""
    run = load_training_run(path)
    summary = summarize_training(run)
    resumes = [launch["steps"][0] for launch in summary.launches[1:] if launch["steps"]]
    summary.curves = str(write_curves_png([run], run.folder / CURVES, resumes))
    others: list[TrainingSummary] = []
    if compare:
        runs = [run, *(load_training_run(other) for other in compare)]
        for other in runs[1:]:
            if other.label == run.label:  # two folders of one name: tell them apart by their paths
                other.label = str(other.folder)
        others = [summarize_training(other) for other in runs[1:]]
        summary.compare = str(write_curves_png(runs, run.folder / COMPARE))
    return summary, others
