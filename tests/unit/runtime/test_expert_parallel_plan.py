"""The expert-parallel dispatch's pure parts against the single-process dispatch, and the EP settings.

Ranks are simulated in one process: the token-slots are planned per rank (:func:`plan_dispatch`), each
rank's block runs on its own slice of the experts (:func:`expert_block_forward`) and the partials are
combined (:func:`combine`); the result must equal :func:`moe.dispatch_experts` over all experts
(fp32, max relative error <= 1e-5) for 1, 2, 4 and 8 ranks. The real multi-process group is tested in
``tests/integration/worker/test_ep_numerics.py``.
"""

from __future__ import annotations

import pytest
import torch

from moeguard_core import contract
from moeguard_core.presets import get_preset
from moeguard_runtime.model.model import build_model
from moeguard_runtime.model.moe import dispatch_experts, route
from moeguard_runtime.parallel.ep_config import (
    ENV_EP_LOCAL_RANK,
    ConfigError,
    expert_range,
    load_ep_settings,
    local_rank_env,
)
from moeguard_runtime.parallel.expert_parallel import (
    balancedness,
    combine,
    expert_block_forward,
    expert_weights,
    plan_dispatch,
    shard_experts,
    strip_to_experts,
    tokens_per_rank,
)

pytestmark = pytest.mark.unit

E, K, D, INTER = 8, 2, 32, 48


def _layer(tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, D, generator=g)
    w13 = torch.randn(E, 2 * INTER, D, generator=g) / D ** 0.5
    w2 = torch.randn(E, D, INTER, generator=g) / INTER ** 0.5
    weights, experts = route(torch.randn(tokens, E, generator=g), K)
    return x, w13, w2, weights, experts


def _sharded(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
             experts: torch.Tensor, ranks: int, backend: str) -> torch.Tensor:
    batches = plan_dispatch(weights, experts, E, ranks)
    partials = []
    for r, b in enumerate(batches):
        lo, hi = expert_range(r, ranks, E)
        partials.append(expert_block_forward(x.index_select(0, b.tokens), b.rows, b.local_expert, b.weight,
                                             w13[lo:hi], w2[lo:hi], backend))  # type: ignore[arg-type]
    return combine(x.shape[0], D, batches, partials, x)


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("tokens", [1, 3, 64, 300])
@pytest.mark.parametrize("backend", ["torch", "onednn"])
def test_sharded_dispatch_equals_single_process(ranks: int, tokens: int, backend: str) -> None:
    x, w13, w2, weights, experts = _layer(tokens, seed=tokens + ranks)
    ref, _, _ = dispatch_experts(x, weights, experts, w13, w2, backend=backend)  # type: ignore[arg-type]
    got = _sharded(x, w13, w2, weights, experts, ranks, backend)
    rel = float((got - ref).abs().max() / ref.abs().max())
    assert rel <= 1e-5, rel


def test_plan_sends_each_token_once_per_rank_with_its_slots() -> None:
    experts = torch.tensor([[0, 1], [5, 7], [1, 6], [2, 3]])
    weights = torch.tensor([[0.6, 0.4], [0.5, 0.5], [0.7, 0.3], [0.9, 0.1]])
    b = plan_dispatch(weights, experts, 8, 2)  # rank 0: experts 0-3, rank 1: 4-7
    assert b[0].tokens.tolist() == [0, 2, 3] and b[0].slots == 5
    assert b[0].rows.tolist() == [0, 0, 1, 2, 2]
    assert b[0].local_expert.tolist() == [0, 1, 1, 2, 3]
    assert b[1].tokens.tolist() == [1, 2] and b[1].local_expert.tolist() == [1, 3, 2]
    assert b[1].rows.tolist() == [0, 0, 1]
    assert torch.allclose(b[1].weight, torch.tensor([0.5, 0.5, 0.3]))


def test_plan_leaves_a_rank_nothing_when_no_token_chose_it() -> None:
    experts = torch.tensor([[0, 1]])
    b = plan_dispatch(torch.tensor([[0.5, 0.5]]), experts, 8, 4)
    assert [x.slots for x in b] == [2, 0, 0, 0] and [x.num_tokens for x in b] == [1, 0, 0, 0]


def test_tokens_per_rank_and_balancedness() -> None:
    counts = [4, 0, 2, 2, 0, 0, 8, 0]
    per = tokens_per_rank(counts, 4)
    assert per == [4, 4, 0, 8]
    assert balancedness(per) == pytest.approx(4 / 8)
    assert balancedness([3, 3]) == 1.0
    assert balancedness([0, 0]) == 1.0


def test_shard_keeps_the_block_and_strip_frees_the_rest() -> None:
    model = build_model(get_preset("tiny"), seed=0)
    full = [(w13.clone(), w2.clone()) for w13, w2 in expert_weights(model)]
    lo, hi = shard_experts(model, 1, 4)
    assert (lo, hi) == (2, 4)
    for (a, b), (w13, w2) in zip(expert_weights(model), full, strict=True):
        assert torch.equal(a, w13[2:4]) and torch.equal(b, w2[2:4])
    freed = strip_to_experts(model)
    assert freed > 0
    assert model.tok_embeddings.weight.numel() == 0
    assert all(w13.numel() > 0 for w13, _ in expert_weights(model))


LWS = {contract.ENV_LWS_LEADER_ADDRESS: "10.0.0.5", contract.ENV_LWS_GROUP_SIZE: "4",
       contract.ENV_LWS_WORKER_INDEX: "2"}


def test_ep_settings_from_the_lws_env() -> None:
    assert load_ep_settings({}) is None
    assert load_ep_settings({contract.ENV_EXPERT_PARALLEL_SIZE: "1", **LWS}) is None
    ep = load_ep_settings({contract.ENV_EXPERT_PARALLEL_SIZE: "4", **LWS})
    assert ep is not None
    assert (ep.rank, ep.size, ep.leader_address, ep.port, ep.timeout_s) == (2, 4, "10.0.0.5", 29500, 30.0)
    assert not ep.is_leader and ep.expert_range(64) == (32, 48)
    ep = load_ep_settings({contract.ENV_EXPERT_PARALLEL_SIZE: "4", contract.ENV_EP_PORT: "29600",
                           contract.ENV_EP_TIMEOUT_SECONDS: "5", **LWS})
    assert ep is not None and (ep.port, ep.timeout_s) == (29600, 5.0)


@pytest.mark.parametrize(("env", "words"), [
    ({contract.ENV_EXPERT_PARALLEL_SIZE: "4"}, "LWS_GROUP_SIZE is required"),
    ({contract.ENV_EXPERT_PARALLEL_SIZE: "6", **LWS}, "must be a multiple of LWS_GROUP_SIZE=4"),
    ({contract.ENV_EXPERT_PARALLEL_SIZE: "8", **LWS, ENV_EP_LOCAL_RANK: "2"}, "must be < 2 ranks per pod"),
    ({contract.ENV_EXPERT_PARALLEL_SIZE: "x", **LWS}, "is not an integer"),
    ({contract.ENV_EXPERT_PARALLEL_SIZE: "4", **LWS, contract.ENV_LWS_WORKER_INDEX: "4"}, "must be < LWS_GROUP_SIZE"),
    ({contract.ENV_EXPERT_PARALLEL_SIZE: "4", **LWS, contract.ENV_LWS_LEADER_ADDRESS: ""}, "LWS_LEADER_ADDRESS"),
    ({contract.ENV_EXPERT_PARALLEL_SIZE: "4", **LWS, contract.ENV_EP_TIMEOUT_SECONDS: "0"}, "(0, 3600]"),
    ({contract.ENV_EXPERT_PARALLEL_SIZE: "4", **LWS, contract.ENV_EP_PORT: "70000"}, "TCP port"),
])
def test_bad_ep_env_is_refused_naming_the_variable(env: dict[str, str], words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        load_ep_settings(env)


def test_several_ranks_per_pod_number_the_pods_ranks_and_give_each_child_its_gpu() -> None:
    ep = load_ep_settings({contract.ENV_EXPERT_PARALLEL_SIZE: "8", **LWS})  # 4 pods, 2 ranks each; pod 2
    assert ep is not None and (ep.rank, ep.ranks_per_pod, ep.local_rank) == (4, 2, 0)
    child_env = local_rank_env({"A": "1", **LWS}, ep, 1, "cuda")
    assert child_env[ENV_EP_LOCAL_RANK] == "1" and child_env[contract.ENV_DEVICE] == "cuda:1" and child_env["A"] == "1"
    child = load_ep_settings({contract.ENV_EXPERT_PARALLEL_SIZE: "8", **child_env})
    assert child is not None and (child.rank, child.local_rank) == (5, 1)
    assert contract.ENV_DEVICE not in local_rank_env({}, ep, 1, "cpu")


def test_capacity_factor_and_indivisible_experts_are_refused() -> None:
    with pytest.raises(ConfigError, match="dropless"):
        load_ep_settings({contract.ENV_EXPERT_PARALLEL_SIZE: "4", **LWS}, capacity_factor=1.25)
    with pytest.raises(ConfigError, match="must divide the model's 6 experts"):
        expert_range(0, 4, 6)
