"""A clone with nothing beside it carries what the main job reads (issue 27).

``git clone`` of this repository into an empty temporary folder; in the clone, the demo's module
imports and its inputs resolve inside the clone: the trace (``bench/traces/``), the example resource
and the prompt corpus. A scan of the tracked files finds no path that leaves the repository for a
sibling folder (a ``shared`` folder beside the checkout).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from harness.stack import ROOT

# Run in the clone: import the demo as `make demo` does and resolve what it reads.
_PROBE = """
import json, sys
sys.argv = ["demo"]
import hack.demo as demo
from harness.loadgen.trace import default_trace_path, load_schedule
from harness.loadgen.text import corpus
s = load_schedule(time_compression=4.0, length_scale=0.25, max_context=1023, max_new_tokens_cap=64, limit=300)
print(json.dumps({"trace": str(default_trace_path()), "source": s.meta.source, "requests": len(s.requests),
                  "example": str(demo.EXAMPLE), "example_exists": demo.EXAMPLE.is_file(),
                  "corpus_chars": len(corpus())}))
"""


def test_a_clone_with_nothing_beside_it_resolves_the_demo_inputs(tmp_path: Path) -> None:
    clone = tmp_path / "moeguard"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(clone)], check=True, timeout=120)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moeguard"]  # nothing beside the clone
    env = {k: v for k, v in os.environ.items() if k != "MOEGUARD_TRACE_PATH"}
    env["PYTHONPATH"] = os.pathsep.join(str(clone / p) for p in ("operator", "runtime", "core", "."))
    res = subprocess.run([sys.executable, "-c", _PROBE], cwd=clone, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    trace = clone / "bench" / "traces" / "azure-llm-inference-2023-conv.csv"
    assert got["trace"] == str(trace) == got["source"]
    assert got["requests"] == 300
    assert got["example"] == str(clone / "examples" / "moeinferenceservice.yaml") and got["example_exists"]
    assert got["corpus_chars"] > 100_000


_OUTSIDE = re.compile(r"\.\./shared\b|parent\s*/\s*[\"']shared[\"']|parents\[\d\]\s*/\s*[\"']shared[\"']")


def test_no_tracked_file_reads_a_folder_beside_the_repository() -> None:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True).stdout.split()
    hits = []
    for name in files:
        path = ROOT / name
        if path.suffix in {".csv", ".json", ".png"} or not path.is_file() or path == Path(__file__):
            continue
        for no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if _OUTSIDE.search(line):
                hits.append(f"{name}:{no}: {line.strip()}")
    assert not hits, "\n".join(hits)
