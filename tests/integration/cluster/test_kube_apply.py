"""kube.apply against the real API server: the user's text reaches the children byte for byte."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client, config
from tests.integration.conftest import Cluster

from moeguard_operator.children import kube
from moeguard_operator.children.builders import Owner, build_children
from moeguard_operator.spec.models import MoEInferenceServiceSpec

# Every plane a user may write in: ASCII with JSON's escapes, Latin-1, CJK, right-to-left, combining
# marks, an astral-plane emoji and musical symbol (UTF-16 surrogate pairs), a ZWJ sequence.
TEXTS = {
    "ascii": 'quotes " and \\ backslash \\u00e9 literally',
    "latin": "crème brûlée",
    "cjk": "日本語のテキスト",
    "rtl": "مرحبا שלום",
    "combining": "e\u0301 n\u0303",
    "emoji": "😀",
    "astral": "𝄞 𐍈",
    "zwj": "👩‍👩‍👧",
}


@pytest.fixture
def configured(cluster: Cluster) -> Iterator[None]:
    """The kubernetes client's default configuration pointed at the local cluster."""
    saved = client.Configuration.get_default_copy()
    config.load_kube_config(config_file=str(cluster.kubeconfig))
    kube._dynamic.cache_clear()
    yield
    client.Configuration.set_default(saved)
    kube._dynamic.cache_clear()


def test_unicode_in_annotations_and_env_reaches_the_deployment_exactly(
        cluster: Cluster, namespace: str, configured: None) -> None:
    spec = MoEInferenceServiceSpec.model_validate({
        "resources": {"gpus": 0},
        "template": {"annotations": {f"example.com/{k}": v for k, v in TEXTS.items()},
                     "extraEnv": [{"name": f"TEXT_{k.upper()}", "value": v} for k, v in TEXTS.items()]},
    })
    owner = Owner(name="unicode", namespace=namespace, uid="00000000-0000-0000-0000-000000000001")
    deployment = next(m for m in build_children(owner, spec) if m["kind"] == "Deployment")
    # no MoEInferenceService owns it here: without this the garbage collector deletes the orphan mid-test
    del deployment["metadata"]["ownerReferences"]
    stored = kube.apply(deployment)
    template = stored["spec"]["template"]
    assert {k: template["metadata"]["annotations"][f"example.com/{k}"] for k in TEXTS} == TEXTS
    env = {e["name"]: e.get("value") for e in template["spec"]["containers"][0]["env"]}
    assert {k: env[f"TEXT_{k.upper()}"] for k in TEXTS} == TEXTS
    # and what the API server holds, read back by kubectl, is the same text
    live = cluster.kubectl_json("-n", namespace, "get", "deployment", deployment["metadata"]["name"])
    assert live["spec"]["template"]["metadata"]["annotations"]["example.com/emoji"] == "😀"
    # applying the same manifest again changes nothing (no escaping drift between applies)
    again = kube.apply(deployment)
    assert again["metadata"]["generation"] == stored["metadata"]["generation"]
