"""How often the trainer's training thread is switched out, and how long it waits to run again.

    python docs/results/scripts/trainer_preemption.py [seconds]

Run it while a job trains (e.g. `laminar bench modes --modes laminar ...` in another shell): it
finds the `ray::TrainerActor` process, reads every thread's voluntary / involuntary context
switches (/proc/PID/task/TID/status) and its CPU time and run-queue wait
(/proc/PID/task/TID/schedstat) twice, `seconds` apart (default 10), and prints the threads that
ran or waited more than 0.2 s in between. Reads /proc only; costs no measurable CPU.
"""
import os
import subprocess
import sys
import time


def snapshot(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        try:
            comm = open(f"{base}/comm").read().strip()
            status = dict(line.split(":", 1) for line in open(f"{base}/status") if ":" in line)
            cpu_ns, wait_ns, slices = map(int, open(f"{base}/schedstat").read().split())
        except OSError:
            continue
        out[tid] = (comm, int(status["voluntary_ctxt_switches"]),
                    int(status["nonvoluntary_ctxt_switches"]), cpu_ns, wait_ns, slices)
    return out


def main():
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
    pids = subprocess.run(["pgrep", "-f", "ray::TrainerActor"], capture_output=True,
                          text=True).stdout.split()
    if not pids:
        sys.exit("no ray::TrainerActor process: start a job first")
    pid = pids[0]
    a = snapshot(pid)
    time.sleep(seconds)
    b = snapshot(pid)
    print(f"trainer pid {pid}, {seconds:g} s")
    for tid, (comm, vol, invol, cpu, wait, slices) in b.items():
        if tid not in a:
            continue
        _, vol0, invol0, cpu0, wait0, slices0 = a[tid]
        dcpu, dwait = (cpu - cpu0) / 1e9, (wait - wait0) / 1e9
        if dcpu > 0.2 or dwait > 0.2:
            print(f"thread {tid} {comm}: voluntary {vol - vol0}, involuntary {invol - invol0}, "
                  f"cpu {dcpu:.2f} s, run-queue wait {dwait:.2f} s, slices {slices - slices0}")


if __name__ == "__main__":
    main()
