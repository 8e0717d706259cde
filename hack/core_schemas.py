#!/usr/bin/env python3
"""Write operator/moeguard_operator/spec/core_v1.json from a running API server's OpenAPI v3 document.

Usage: hack/core_schemas.py [--kubeconfig PATH]   (default: the local cluster's, $MOEGUARD_RUN_DIR/kubeconfig)

Run it after changing KUBERNETES_VERSION in hack/versions.env (with that version's cluster up),
then `make manifests`. tests/integration/cluster/test_core_schemas.py fails while the file differs
from what the running API server serves.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "operator"), str(ROOT / "runtime"), str(ROOT / "core")]

from harness.stack import RUN_DIR, kubectl  # noqa: E402

from moeguard_operator.spec.core_schemas import SCHEMA_FILE, build_file  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", type=Path, default=RUN_DIR / "kubeconfig")
    args = parser.parse_args()
    document = json.loads(kubectl(f"--kubeconfig={args.kubeconfig}", "get", "--raw", "/openapi/v3/api/v1").stdout)
    SCHEMA_FILE.write_text(json.dumps(build_file(document), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SCHEMA_FILE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
