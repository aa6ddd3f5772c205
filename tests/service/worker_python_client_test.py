#!/usr/bin/python3
"""End-to-end test of examples/python/client.py against `strata serve` on a tiny random model.

Starts `strata serve` as a child process on 127.0.0.1 (free ports from --port-file), runs the
example client twice on the same document (token ids) and checks the final jobs: DONE, the same
greedy tokens both times, cached tokens == document tokens. Every child is killed and waited for;
every wait is bounded.

  /usr/bin/python3 tests/service/worker_python_client_test.py --strata build-worker/cli/strata
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strata", required=True)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="strata_pyclient_test_")
    server = None
    try:
        subprocess.run([args.strata, "make-model", "--preset", "tiny", "--seed", "5", "--out", f"{tmp}/model"],
                       check=True, timeout=60, stdout=subprocess.DEVNULL)
        log = open(f"{tmp}/serve.log", "w")
        server = subprocess.Popen([args.strata, "serve", "--model", f"{tmp}/model", "--data", f"{tmp}/data",
                                   "--listen", "127.0.0.1:0", "--port-file", f"{tmp}/ports", "--no-sync",
                                   "--drain-timeout-seconds", "2"], stdout=log, stderr=log)
        deadline = time.time() + 60
        port = 0
        while time.time() < deadline and port == 0:
            if server.poll() is not None:
                raise RuntimeError("strata serve exited: " + open(f"{tmp}/serve.log").read())
            try:
                port = int(open(f"{tmp}/ports").read().split()[0])
            except (OSError, ValueError, IndexError):
                time.sleep(0.05)
        assert port > 0, "no port file"
        doc = ",".join(str(3 + (i * 31) % 400) for i in range(300))
        results = []
        for _ in range(2):
            out = subprocess.run(["/usr/bin/python3", os.path.join(REPO, "examples/python/client.py"), "--server",
                                  f"127.0.0.1:{port}", "--doc-token-ids", doc, "--prompt-token-ids", "7,8,9",
                                  "--max-tokens", "5", "--timeout", "60", "--json"],
                                 check=True, timeout=120, capture_output=True, text=True)
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        for r in results:
            assert r["state"] == "DONE", r
            assert r["usage"]["cached_tokens"] == 300, r
            assert r["usage"]["prompt_tokens"] == 303, r
            assert 1 <= len(r["output_token_ids"]) <= 5, r
        assert results[0]["output_token_ids"] == results[1]["output_token_ids"], results
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
        server = None
        print("PASS", results[0]["output_token_ids"])
        return 0
    finally:
        if server is not None:
            server.kill()
            server.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
