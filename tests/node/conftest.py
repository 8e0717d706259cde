"""tests/node: end to end on the real node (hack/node-up.sh), run by ``make test-node`` only.

``make test`` collects nothing here (the tests need root, containerd, a kubelet and images of
several GB: minutes, not seconds); ``make test-node`` sets ``MOEGUARD_TEST_NODE=1`` after it has
started the cluster and the node and written ``<run dir>/node/images.env``.
"""

from __future__ import annotations

import os

collect_ignore_glob = [] if os.environ.get("MOEGUARD_TEST_NODE") == "1" else ["test_*.py"]
