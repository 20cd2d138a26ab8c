"""What a SCHED_IDLE thread gets next to a busy normal-class process (docs/performance.md,
"Rollouts under SCHED_IDLE"): on one core, a `while True: pass` at nice 0 (an unrelated busy
program) beside a second busy loop at nice 4 (`rollout.cpu_nice`, normal class), then beside
the same loop under SCHED_IDLE (`rollout.cpu_sched=idle`); the CPU share each got over
`seconds` (default 5).

    python docs/results/scripts/idle_starvation.py [seconds]
"""
import os
import sys
import time


def spin(nice, idle):
    os.sched_setaffinity(0, {0})
    os.nice(nice)
    if idle:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while True:
        pass


def cpu_s(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(nice, idle):
    pid = os.fork()
    if pid == 0:
        spin(nice, idle)
    return pid


def main():
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 5.0
    for label, idle in (("nice 4, normal class", False), ("nice 4, SCHED_IDLE", True)):
        busy, ours = start(0, False), start(4, idle)
        time.sleep(0.5)
        b0, o0 = cpu_s(busy), cpu_s(ours)
        time.sleep(seconds)
        b, o = cpu_s(busy) - b0, cpu_s(ours) - o0
        for pid in (busy, ours):
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        print(f"{label}: beside a busy nice-0 loop on one core it got {o / seconds:.1%} of the "
              f"core (the busy loop {b / seconds:.1%})")


if __name__ == "__main__":
    main()
