#!/usr/bin/python3
"""The KV cache hit ratios of a real multi-process Strata in a real Prometheus.

Starts scripts/local_cluster.sh (strata kvstore, strata coordinator, two strata workers on
127.0.0.1, tiny random model) and Debian's `prometheus` server on a free loopback port with a temp
TSDB, scraping every process's /metrics every second and loading deploy/prometheus/rules/ (copied to
a temp dir with the rule groups' evaluation interval set to 1 s: the shipped 30 s would leave the
first evaluation up to 30 s away). Then, through the public API (`strata doc upload`, `strata ask`
twice: the second answer reuses the document's persisted KV pages), runs jobs and polls Prometheus'
HTTP API until the recording rule strata:kv_hit_ratio:rate5m returns per-tier series; checks that
every tier with lookups (strata:kv_lookups:rate5m > 0) has a ratio in [0, 1], that at least one does,
and that strata_kv_lookups_total (worker side) grew over the run.

  tests/deploy/prometheus_live_test.py STRATA_BINARY

Registered with ctest as deploy.prometheus_live (label deploy). A missing prometheus or curl fails
the test (scripts/install_deps.sh installs them); it never skips. Uses only the Python standard
library (run with Debian's /usr/bin/python3).
"""

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START = time.monotonic()


def log(msg):
    print(f"[{time.monotonic() - START:6.1f}s] {msg}", flush=True)


class Failure(Exception):
    pass


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def query(prom, expr):
    """Instant query; returns the result vector (list of {metric, value})."""
    url = f"http://{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    body = json.loads(http_get(url))
    if body.get("status") != "success":
        raise Failure(f"query {expr!r} failed: {body}")
    return body["data"]["result"]


def value(sample):
    return float(sample["value"][1])  # "NaN" parses to nan


def stop(proc, name, timeout):
    """SIGTERM, wait up to `timeout` s, then SIGKILL the process group; always waits."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log(f"{name} did not stop in {timeout} s: killing its process group")
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def kill_leftovers(pids_file):
    """The cluster's processes run in their own sessions: when local_cluster.sh had to be killed,
    SIGKILL those it still lists (DATA/pids, "NAME PID" lines) and wait until they are gone."""
    if not os.path.exists(pids_file):
        return
    pids = []
    for line in open(pids_file):
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            pids.append(int(parts[1]))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            log(f"killed leftover pid {pid}")
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in pids):
        time.sleep(0.1)


def run(cmd, timeout):
    log("$ " + " ".join(cmd))
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    for line in r.stdout.splitlines()[-6:]:
        log("  | " + line)
    if r.returncode != 0:
        raise Failure(f"{cmd[1]} exited {r.returncode}")
    return r.stdout


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    binary = os.path.abspath(sys.argv[1])
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        print("FAIL: the `prometheus` server is not installed (Debian package prometheus; "
              "scripts/install_deps.sh installs it)", file=sys.stderr)
        return 1
    if shutil.which("curl") is None:
        print("FAIL: curl is not installed (scripts/install_deps.sh)", file=sys.stderr)
        return 1
    if not os.access(binary, os.X_OK):
        print(f"FAIL: strata binary {binary} not found", file=sys.stderr)
        return 1

    work = tempfile.mkdtemp(prefix="strata-prom-live.")
    cluster = prom_proc = None
    prom_log = None
    try:
        # 1. The cluster.
        data = os.path.join(work, "cluster")
        cluster_log = open(os.path.join(work, "local_cluster.log"), "w")
        cluster = subprocess.Popen(
            ["bash", os.path.join(REPO, "scripts/local_cluster.sh"), "start", data, "--binary", binary,
             "--scrape-interval", "1s", "--drain-timeout-seconds", "5"],
            stdout=cluster_log, stderr=subprocess.STDOUT, start_new_session=True)
        endpoints_file = os.path.join(data, "endpoints.env")
        deadline = time.monotonic() + 90
        while not os.path.exists(endpoints_file):
            if cluster.poll() is not None:
                raise Failure(f"local_cluster.sh exited {cluster.returncode}:\n"
                              + open(cluster_log.name).read())
            if time.monotonic() > deadline:
                raise Failure("local_cluster.sh did not come up in 90 s:\n" + open(cluster_log.name).read())
            time.sleep(0.2)
        endpoints = dict(line.strip().split("=", 1) for line in open(endpoints_file) if "=" in line)
        log("cluster up: " + " ".join(f"{k}={v}" for k, v in sorted(endpoints.items()) if k != "MODEL"))

        # 2. Prometheus, with the rules copied and their group interval set to 1 s.
        rules = os.path.join(work, "rules")
        os.makedirs(rules)
        shipped = os.path.join(REPO, "deploy/prometheus/rules")
        for name in sorted(os.listdir(shipped)):
            text = open(os.path.join(shipped, name)).read()
            text = re.sub(r"(?m)^(\s*)interval:\s*\S+", r"\1interval: 1s", text)
            open(os.path.join(rules, name), "w").write(text)
        config = open(os.path.join(data, "prometheus.yml")).read().replace(shipped, rules)
        if rules not in config:
            raise Failure("the cluster's prometheus.yml does not load deploy/prometheus/rules/")
        config_path = os.path.join(work, "prometheus.yml")
        open(config_path, "w").write(config)
        prom = f"127.0.0.1:{free_port()}"
        prom_log = open(os.path.join(work, "prometheus.log"), "w")
        prom_proc = subprocess.Popen(
            [prometheus, f"--config.file={config_path}", f"--storage.tsdb.path={work}/tsdb",
             f"--web.listen-address={prom}"],
            stdout=prom_log, stderr=subprocess.STDOUT, start_new_session=True)
        prom_started = time.monotonic()
        deadline = prom_started + 30
        while True:
            if prom_proc.poll() is not None:
                raise Failure(f"prometheus exited {prom_proc.returncode}:\n" + open(prom_log.name).read()[-3000:])
            try:
                http_get(f"http://{prom}/-/ready", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise Failure("prometheus not ready in 30 s")
                time.sleep(0.2)
        # All four targets scraped and up.
        deadline = time.monotonic() + 30
        while True:
            up = query(prom, "up")
            if len(up) == 4 and all(value(s) == 1 for s in up):
                break
            if time.monotonic() > deadline:
                raise Failure(f"targets not all up after 30 s: {up}")
            time.sleep(0.5)
        log(f"prometheus {prom}: 4 targets up {time.monotonic() - prom_started:.1f} s after start")
        lookups_expr = 'sum(strata_kv_lookups_total{component!="kvstore"})'
        before = query(prom, lookups_expr)
        lookups_before = value(before[0]) if before else 0.0
        log(f"worker-side strata_kv_lookups_total before the jobs: {lookups_before:g}")

        # 3. Jobs through the public API.
        server = endpoints["COORDINATOR"]
        doc = os.path.join(work, "doc.txt")
        with open(doc, "w") as f:
            for i in range(40):
                f.write(f"Paragraph {i}: the tiered KV cache keeps the pages of document {i % 7} "
                        f"on GPU, host memory, disk and the remote store. ")
        run([binary, "doc", "upload", doc, "--server", server], timeout=60)
        for i in range(2):
            t0 = time.monotonic()
            run([binary, "ask", "--server", server, "--doc", doc, "--max-tokens", "4", "--seed", "7",
                 f"question {i}: where are the pages kept?"], timeout=90)
            log(f"ask {i + 1} took {time.monotonic() - t0:.2f} s")
        jobs_done = time.monotonic()

        # 4. Poll the recording rule.
        deadline = jobs_done + 40
        while True:
            ratios = query(prom, "strata:kv_hit_ratio:rate5m")
            rates = {s["metric"].get("tier", ""): value(s) for s in query(prom, "strata:kv_lookups:rate5m")}
            after = query(prom, lookups_expr)
            lookups_after = value(after[0]) if after else 0.0
            with_lookups = [s for s in ratios if rates.get(s["metric"].get("tier", ""), 0) > 0]
            if with_lookups and lookups_after > lookups_before:
                break
            if time.monotonic() > deadline:
                raise Failure(f"no strata:kv_hit_ratio:rate5m series for a tier with lookups 40 s after the "
                              f"jobs (ratios {ratios}, lookup rates {rates}, lookups {lookups_before:g} -> "
                              f"{lookups_after:g})")
            time.sleep(1)
        log(f"strata:kv_hit_ratio:rate5m present {time.monotonic() - jobs_done:.1f} s after the last job "
            f"({time.monotonic() - prom_started:.1f} s after prometheus started)")
        bad = []
        for s in sorted(ratios, key=lambda s: s["metric"].get("tier", "")):
            tier = s["metric"].get("tier", "")
            v = value(s)
            log(f"  tier={tier:7s} hit_ratio={v:.4f} lookups_rate5m={rates.get(tier, 0):.4f}/s")
            if rates.get(tier, 0) > 0:
                if math.isnan(v) or not 0.0 <= v <= 1.0:
                    bad.append(f"tier {tier}: {v}")
            elif not math.isnan(v):  # no lookups: 0/0
                bad.append(f"tier {tier} has no lookups but ratio {v}")
        if bad:
            raise Failure("hit ratios out of [0, 1]: " + ", ".join(bad))
        for s in query(prom, "strata_kv_lookups_total"):
            m = s["metric"]
            log(f"  strata_kv_lookups_total{{component={m.get('component')},instance={m.get('instance')},"
                f"tier={m.get('tier')}}} = {value(s):g}")
        for s in query(prom, "strata_kv_hits_total"):
            m = s["metric"]
            log(f"  strata_kv_hits_total{{component={m.get('component')},instance={m.get('instance')},"
                f"tier={m.get('tier')}}} = {value(s):g}")
        log(f"worker-side strata_kv_lookups_total: {lookups_before:g} -> {lookups_after:g}")
        health = json.loads(http_get(f"http://{prom}/api/v1/rules"))
        unhealthy = [r["name"] for g in health["data"]["groups"] for r in g["rules"] if r.get("health") != "ok"]
        if unhealthy:
            raise Failure(f"unhealthy rules: {unhealthy}")
        log(f"{sum(len(g['rules']) for g in health['data']['groups'])} rules loaded, all healthy")
        print("PASS prometheus_live", flush=True)
        return 0
    except (Failure, subprocess.TimeoutExpired, OSError, KeyError, ValueError) as e:
        print(f"FAIL: {e}", file=sys.stderr, flush=True)
        for name in ("coordinator.log", "worker0.log", "worker1.log", "kvstore.log"):
            path = os.path.join(work, "cluster", name)
            if os.path.exists(path):
                print(f"--- tail of {name}", file=sys.stderr)
                print("".join(open(path).readlines()[-15:]), file=sys.stderr)
        return 1
    finally:
        stop(prom_proc, "prometheus", 10)
        t0 = time.monotonic()
        stop(cluster, "local_cluster.sh", 40)
        if cluster is not None:
            log(f"cluster stopped in {time.monotonic() - t0:.1f} s (exit {cluster.returncode})")
            kill_leftovers(os.path.join(work, "cluster", "pids"))
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
