#!/usr/bin/env python3
"""Elastic start-up, re-form and loss of every rank at N agents on one host (issue 77, item 3).

For each N given: N `ddprun --nnodes 2:N --node-rank K --nproc-per-node 1 --max-restarts 2`
agents on this host, each running comm's `ddp-elastic-peer` (an elastic rank whose step is one
all-reduce of 1000 floats and the commit vote, `PEER_SLEEP_MS` apart: the membership's own
costs, without a model's), then:

- start-up: seconds from the first agent's start to the first committed step (generation 1,
  founded by those that asked within the last call once MIN had) and to the first step at
  world N (the others admitted at step boundaries);
- re-form: one rank killed (SIGKILL) once the world is N: seconds from the kill to the
  survivors' next generation (the last survivor to say it) and to their next step;
- every rank killed at once: seconds from the kill to the restarted ranks' new round (its
  first committed step; the ranks have no checkpoint).

Each agent's output goes to a file in a temporary folder, parsed afterwards; every agent and
rank is killed at the end (only the processes this script started). Prints one Markdown
table row per N.

    python3 xtask/py/elastic_scale.py --bin-dir target/release 16 32 64 128
"""
import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def children(pid):
    """The pids whose parent is `pid`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
        except OSError:
            continue
        rest = stat.rsplit(") ", 1)[1].split()
        if int(rest[1]) == pid:
            found.append(int(entry))
    return found


def lines_of(paths):
    out = []
    for p in paths:
        try:
            out.extend(open(p, errors="replace").read().splitlines())
        except OSError:
            pass
    return out


STEP = re.compile(r"elastic slot (\d+) gen (\d+) rank \d+ world (\d+) step (\d+) at (\d+)")
REFORMED = re.compile(r"elastic slot (\d+) reformed gen (\d+) rank \d+ world (\d+) .* at (\d+)")
ROUND = re.compile(r"elastic slot (\d+) new round gen (\d+) rank \d+ world (\d+) at (\d+)")


def wait_until(pred, timeout, what):
    until = time.time() + timeout
    while time.time() < until:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise TimeoutError(f"no {what} within {timeout} s")


def run(n, bin_dir, sleep_ms, timeout, keep):
    tmp = tempfile.mkdtemp(prefix=f"elastic-scale-{n}-")
    if keep:
        print(f"{n} agents: logs in {tmp}", file=sys.stderr)
    port = free_port()
    env = dict(os.environ)
    for k in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]:
        env.pop(k, None)
    env["RUST_LOG"] = "warn"
    agents = []
    files = []
    t0 = time.time()
    try:
        for k in range(n):
            path = os.path.join(tmp, f"agent{k}.log")
            files.append(path)
            out = open(path, "w")
            cmd = [
                os.path.join(bin_dir, "ddprun"), "--grace-period", "1", "--nnodes", f"2:{n}",
                "--node-rank", str(k), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                "--master-port", str(port), "--max-restarts", "2", "--", "env",
                "PEER_STEPS=1000000", f"PEER_SLEEP_MS={sleep_ms}", "DDP_CONNECT_TIMEOUT=600",
                os.path.join(bin_dir, "ddp-elastic-peer"),
            ]
            agents.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                           stdin=subprocess.DEVNULL))
        t0_ms = t0 * 1000

        def steps():
            return [tuple(map(int, m.groups())) for m in map(STEP.search, lines_of(files)) if m]

        first = wait_until(lambda: steps(), timeout, "first step")
        first_ms = min(s[4] for s in first) - t0_ms
        full = wait_until(lambda: [s for s in steps() if s[2] == n], timeout, f"a step at world {n}")
        full_ms = min(s[4] for s in full) - t0_ms
        # Re-form: kill the rank of the last agent.
        victim = children(agents[-1].pid)
        victim = [p for p in victim if open(f"/proc/{p}/comm").read().startswith("ddp-elastic")]
        gen_before = max(s[1] for s in steps())
        killed = time.time() * 1000
        os.kill(victim[0], signal.SIGKILL)

        def reformed():
            rs = [tuple(map(int, m.groups())) for m in map(REFORMED.search, lines_of(files)) if m]
            rs = [r for r in rs if r[1] > gen_before and r[2] == n - 1]
            return rs if len(rs) >= n - 1 else None

        rs = wait_until(reformed, timeout, "the survivors' re-form")
        reform_ms = max(r[3] for r in rs) - killed
        gen_after = max(r[1] for r in rs)
        nxt = wait_until(lambda: [s for s in steps() if s[1] == gen_after], timeout, "next step")
        next_ms = min(s[4] for s in nxt) - killed
        # Back at world N (the killed rank restarted and healed), then every rank killed.
        wait_until(lambda: [s for s in steps() if s[2] == n and s[1] > gen_after], timeout,
                   f"world {n} again")
        ranks = []
        for a in agents:
            ranks.extend(p for p in children(a.pid)
                         if open(f"/proc/{p}/comm").read().startswith("ddp-elastic"))
        killed_all = time.time() * 1000
        for p in ranks:
            os.kill(p, signal.SIGKILL)

        def new_round():
            rs = [tuple(map(int, m.groups())) for m in map(ROUND.search, lines_of(files)) if m]
            return [r for r in rs if r[3] > killed_all] or None

        rounds = wait_until(new_round, timeout, "a new round")
        g = max(r[1] for r in rounds)
        after = wait_until(lambda: [s for s in steps() if s[1] >= g and s[4] > killed_all],
                           timeout, "the new round's first step")
        round_ms = min(s[4] for s in after) - killed_all
        world = max(r[2] for r in rounds)
        return dict(n=n, first=first_ms / 1000, full=full_ms / 1000, reform=reform_ms / 1000,
                    next=next_ms / 1000, round=round_ms / 1000, round_world=world)
    finally:
        # Each agent stopped first (so that it starts nothing more), then its ranks, then it.
        for a in agents:
            try:
                os.kill(a.pid, signal.SIGSTOP)
            except OSError:
                continue
            for p in children(a.pid):
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
            a.kill()
        for a in agents:
            a.wait()
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("agents", type=int, nargs="+")
    ap.add_argument("--bin-dir", default="target/release")
    ap.add_argument("--sleep-ms", type=int, default=100)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--keep", action="store_true", help="keep the agents' logs (printed)")
    a = ap.parse_args()
    print("| agents | first step (s) | world N (s) | re-form after a kill (s) | next step (s) "
          "| every rank killed: new round's first step (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n in a.agents:
        try:
            r = run(n, a.bin_dir, a.sleep_ms, a.timeout, a.keep)
            print(f"| {n} | {r['first']:.2f} | {r['full']:.2f} | {r['reform']:.2f} | "
                  f"{r['next']:.2f} | {r['round']:.2f} (world {r['round_world']}) |", flush=True)
        except TimeoutError as e:
            print(f"| {n} | {e} | | | | |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
