"""Kubernetes probe for TorchServe 0.12, run in the container (stdlib only).

    python3 probe.py live         GET /ping on the inference port: 200 until a worker stays
                                  down past maxRetryTimeoutInSec (pytorch/serve@v0.12.0:
                                  frontend/server/src/main/java/org/pytorch/serve/util/
                                  ApiUtils.java:382-397, wlm/WorkerThread.java:575-582)
    python3 probe.py ready MODEL  GET /models/MODEL on the loopback management API: at least
                                  one worker READY (/ping is 200 while workers still load)

Exit 0 = pass. Shipped in the exported ConfigMap by `inf2serve export --target kubernetes`.
"""

import json
import os
import sys
import urllib.request

INFERENCE = os.environ.get("PROBE_INFERENCE_URL", "http://127.0.0.1:8080")
MANAGEMENT = os.environ.get("PROBE_MANAGEMENT_URL", "http://127.0.0.1:8081")


def get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status, r.read()


def main(argv: list[str]) -> int:
    try:
        if argv[1] == "live":
            return 0 if get(INFERENCE + "/ping")[0] == 200 else 1
        _, body = get(MANAGEMENT + "/models/" + argv[2])
        workers = [w for m in json.loads(body) for w in m.get("workers", [])]
        return 0 if any(w.get("status") == "READY" for w in workers) else 1
    except (OSError, ValueError, IndexError, AttributeError, TypeError) as exc:
        print(f"probe: {exc!r}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
