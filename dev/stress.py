"""Train while the machine is overloaded, to check that a run on emulated CPU devices survives.

XLA's CPU collectives abort a run (SIGABRT, "Termination timeout ... exceeded. Expected 4
threads to join the rendezvous, but only 3 of them arrived on time") when one emulated
device's thread reaches a collective too long after the others; the scripts raise that limit
(common.start_devices). This tool recreates the condition: it starts busy loops on
every core and, with --starve, pins one emulated device's thread to the last core beside
busy loops of higher priority, so that thread runs far behind the others. It prints how the
run ended and how many "stuck" warnings and aborts XLA printed.

  python dev/stress.py -- python fsdp.py --cpu-devices 4 --steps 2000
  python dev/stress.py --busy-per-core 8 --starve -- python fsdp.py --cpu-devices 4 --steps 2000
  python dev/stress.py --runs 8 --busy-per-core 4 -- python fsdp.py --cpu-devices 4 --steps 300
  # the limit XLA had before the scripts raised it, scaled down to abort within seconds:
  XLA_FLAGS=--xla_cpu_collective_call_terminate_timeout_seconds=2 \\
    python dev/stress.py --starve -- python fsdp.py --cpu-devices 4 --steps 200

Linux only (thread affinity); --starve raises the busy loops' priority, which needs root, and
otherwise runs them at normal priority.
"""

import argparse
import os
import subprocess
import sys
import threading
import time

BUSY = [sys.executable, "-c", "while True: pass"]


def device_threads(pid: int) -> list:
    """The threads of a process that run XLA's CPU devices (named tf_XLAEigen)."""
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as comm:
                if "XLAEigen" in comm.read():
                    found.append(int(tid))
        except OSError:
            pass
    return found


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--busy-per-core", type=int, default=4, help="busy loops per core")
    parser.add_argument(
        "--starve", action="store_true", help="run one emulated device's thread far behind"
    )
    parser.add_argument(
        "--starve-nice", type=int, default=-10, help="niceness of the busy loops beside that thread"
    )
    parser.add_argument(
        "--runs", type=int, default=1, help="start this many copies of the command at once"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the training command after --")
    cores = sorted(os.sched_getaffinity(0))
    busy = []
    start = time.monotonic()
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    runs += [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(args.runs - 1)
    ]
    run = runs[0]
    outputs = [[] for _ in runs]
    try:
        if args.starve:
            deadline = time.monotonic() + 120
            while (
                len(device_threads(run.pid)) < 2
                and run.poll() is None
                and time.monotonic() < deadline
            ):
                time.sleep(0.2)
            threads = device_threads(run.pid)
            last = cores[-1]
            # The whole run away from the last core...
            for tid in os.listdir(f"/proc/{run.pid}/task"):
                os.sched_setaffinity(int(tid), set(cores[:-1]) or {last})
            # ...but one device thread, alone with busy loops
            os.sched_setaffinity(threads[0], {last})
            print(
                f"starving thread {threads[0]} of {len(threads)} device threads on core {last}",
                flush=True,
            )
        for core in cores:
            for _ in range(args.busy_per_core):
                loop = subprocess.Popen(BUSY)
                os.sched_setaffinity(loop.pid, {core})
                if args.starve and core == cores[-1]:
                    try:
                        os.setpriority(os.PRIO_PROCESS, loop.pid, args.starve_nice)
                    except PermissionError:
                        pass
                busy.append(loop)
        print(
            f"{len(busy)} busy loops on {len(cores)} cores; {len(runs)} x: {' '.join(command)}",
            flush=True,
        )

        # As it comes, so that a run stopped from outside still shows (the first run's)
        def read(i):
            for line in runs[i].stdout:
                if i == 0:
                    print(line, end="", flush=True)
                outputs[i].append(line.rstrip("\n"))

        readers = [threading.Thread(target=read, args=(i,)) for i in range(len(runs))]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join()
        for each in runs:
            each.wait()
    finally:
        for loop in busy:
            loop.kill()
        for each in runs:
            if each.poll() is None:
                each.kill()
    for i, (each, lines) in enumerate(zip(runs, outputs, strict=True)):
        steps = [line for line in lines if line.startswith("step ")]
        print(
            f"run {i}: exit status {each.returncode} after {time.monotonic() - start:.0f}s; last: "
            f"{steps[-1] if steps else 'no step'}; XLA 'may be stuck' warnings: "
            f"{sum('may be stuck' in line for line in lines)}, aborts: "
            f"{sum('Termination timeout' in line for line in lines)}, stalls: "
            f"{sum('no progress for' in line for line in lines)}"
        )
    sys.exit(max(each.returncode for each in runs))


if __name__ == "__main__":
    main()
