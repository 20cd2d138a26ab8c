"""Experiment (2026-12-06, docs/performance.md): every 0.2 s, put every thread of every rollout
under SCHED_BATCH or SCHED_IDLE (their nice kept). Root.

    laminar bench modes ... --out X.json &  python rollout_policy.py batch <the bench's pid>
"""
import os, sys, time
policy = {"batch": os.SCHED_BATCH, "idle": os.SCHED_IDLE}[sys.argv[1]]; driver = int(sys.argv[2])
while True:
    try:
        os.kill(driver, 0)
    except OSError:
        break
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"ray::RolloutActor" in cmd:
            try:
                for t in os.listdir(f"/proc/{pid}/task"):
                    if os.sched_getscheduler(int(t)) != policy:
                        os.sched_setscheduler(int(t), policy, os.sched_param(0))
            except OSError:
                pass
    time.sleep(0.2)
