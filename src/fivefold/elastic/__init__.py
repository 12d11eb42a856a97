"""Keeping a run alive: restarts after a worker dies, re-planning on a new world size, the loss guard,
stragglers, hung collectives, and the recovery report.

    events.py      RUN/events.jsonl and RUN/pids/: what survives a restart (no torch)
    restart.py     a restarted incarnation continues from the newest complete checkpoint (no torch)
    replan.py      the best runnable plan for another process count, same global batch (no torch)
    guard.py       skip NaN/Inf/spiking updates, roll back after K in a row; fault-injection knob (no torch)
    stragglers.py  per-rank forward compute times -> persistently slow ranks, with their host
    hang.py        collective timeout for every process group, per-restart store, the hang knob
    agent.py       the launcher's handler on torch elastic's metrics: when failures were detected
    report.py      RUN/recovery.json: failures, time lost per phase, effective training-time ratio (no torch)

The training loop (runtime/train.py) and the launcher (runtime/launch.py) call into these; nothing here
imports torch at module level except agent.py and the torch parts of hang.py / stragglers.py (lazily).
"""
