"""Experiment (2026-12-06, docs/performance.md): every 0.5 s, set nice N on the job's service
processes (pools, manager, relays, raylet, gcs, the driver), keep the trainer at 0 and the
rollouts at rollout.cpu_nice's 4 (workers forked by a reniced raylet inherit its nice). Root.

    laminar bench modes ... --out X.json &  python service_nice.py 5 <the bench's pid>
"""
import os, sys, time
N = int(sys.argv[1]); driver = int(sys.argv[2])
services = ("ray::PromptPool", "ray::PartialPool", "ray::ExperienceBuffer", "ray::ManagerActor", "ray::Relay")
while True:
    try:
        os.kill(driver, 0)
    except OSError:
        break
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        want = None
        if "ray::TrainerActor" in cmd or "ray::TrainerRank" in cmd:
            want = 0
        elif "ray::RolloutActor" in cmd:
            want = 4
        elif int(pid) == driver or any(x in cmd for x in services) or "raylet" in cmd or "gcs_server" in cmd:
            want = N
        if want is not None:
            try:
                for t in os.listdir(f"/proc/{pid}/task"):
                    if os.getpriority(os.PRIO_PROCESS, int(t)) != want:
                        os.setpriority(os.PRIO_PROCESS, int(t), want)
            except OSError:
                pass
    time.sleep(0.5)
