"""Priority experiments beside a running benchmark (2026-12-06, docs/performance.md, "The
default reverse workload on 9df39cc"). Root; every 0.2 s (the nice run of that day polled every
0.5 s) until the benchmark's process ends:

    python priority_experiment.py services-nice N PID   # pools, manager, relays, raylet, gcs and
        # the driver PID at nice N; the trainer kept at 0 and the rollouts at rollout.cpu_nice's
        # 4 (workers forked by a reniced raylet inherit its nice)
    python priority_experiment.py rollouts batch|idle PID  # every rollout thread under
        # SCHED_BATCH / SCHED_IDLE, its nice kept
    python priority_experiment.py services-core C PID  # the same services pinned to core C;
        # the trainer and the rollouts kept on every core (workers forked by a pinned raylet
        # inherit its core)

e.g. `laminar bench modes ... --out X.json & python priority_experiment.py rollouts batch $!`
"""
import os
import sys
import time

SERVICES = (b"ray::PromptPool", b"ray::PartialPool", b"ray::ExperienceBuffer", b"ray::ManagerActor",
            b"ray::Relay", b"raylet", b"gcs_server")


def wanted_nice(pid, cmd, n, driver):
    if b"ray::TrainerActor" in cmd or b"ray::TrainerRank" in cmd:
        return 0
    if b"ray::RolloutActor" in cmd:
        return 4
    return n if pid == driver or any(s in cmd for s in SERVICES) else None


ALL = set(range(os.cpu_count()))


def main():
    what, arg, driver = sys.argv[1], sys.argv[2], int(sys.argv[3])
    policy = {"batch": os.SCHED_BATCH, "idle": os.SCHED_IDLE}.get(arg)
    while True:
        try:
            os.kill(driver, 0)
        except OSError:
            return
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read()
                tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
                if what == "services-nice":
                    want = wanted_nice(int(pid), cmd, int(arg), driver)
                    for t in tids if want is not None else ():
                        if os.getpriority(os.PRIO_PROCESS, t) != want:
                            os.setpriority(os.PRIO_PROCESS, t, want)
                elif what == "services-core":
                    role = wanted_nice(int(pid), cmd, 1, driver)  # 0: trainer, 4: rollout
                    cores = None if role is None else ALL if role in (0, 4) else {int(arg)}
                    for t in tids if cores else ():
                        if os.sched_getaffinity(t) != cores:
                            os.sched_setaffinity(t, cores)
                elif b"ray::RolloutActor" in cmd:
                    for t in tids:
                        if os.sched_getscheduler(t) != policy:
                            os.sched_setscheduler(t, policy, os.sched_param(0))
            except OSError:
                continue  # the process or thread ended meanwhile
        time.sleep(0.2)


if __name__ == "__main__":
    main()
