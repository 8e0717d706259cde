"""One look for many services (issue 11 §4) and only the Running pods' series (issue 18 §3–5): the pure
slicing of grouped answers (:func:`observe.slice_look`)."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moeguard_core.family_shape import from_model_args
from moeguard_core.memory_model_info import ModelMemory, info_labels
from moeguard_core.presets import get_preset
from moeguard_operator.loop import observe as observe_mod
from moeguard_operator.loop.conditions import leak_unknown
from moeguard_operator.loop.observe import (
    DIAG_FIELDS,
    MALFORMED,
    MIN_WINDOW_SAMPLES,
    Answer,
    Look,
    Queries,
    Target,
    group_answer,
    history_ok,
    observe_looks,
    queries,
    query_plan,
    read_answer,
    service_slice,
    slice_look,
    steady_growth_steps,
)
from moeguard_operator.loop.policy import PolicyState, decide, initial_budgets
from moeguard_operator.spec.models import MoEInferenceServiceSpec

pytestmark = pytest.mark.unit

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
URL = "http://prom:9090"
GIB = 2**30


def series(ns: str, svc: str, pod: str, value: float | str, **extra: str) -> dict[str, Any]:
    return {"metric": {"namespace": ns, "moeis": svc, "pod": pod, **extra}, "value": [1.0, str(value)]}


def answer(*entries: dict[str, Any]) -> Answer:
    body = {"status": "success", "data": {"resultType": "vector", "result": list(entries)}}
    return read_answer(200, json.dumps(body).encode())


def pod_answers(pods: dict[tuple[str, str, str], dict[str, float | str]]) -> dict[str, Answer]:
    """Answers for every query from ``{(ns, svc, pod): {query: value}}``; a query a pod lacks is absent."""
    out = {}
    for field in Queries.__dataclass_fields__:
        out[field] = answer(*(series(ns, svc, pod, values[field]) for (ns, svc, pod), values in pods.items()
                              if field in values))
    return out


def healthy(memory: float = GIB / 2, steps: float = 10, skew: float = 2.0, samples: float = 15,
            slope: float = 0.0) -> dict[str, float | str]:
    return {"skew": skew, "skew_steps": steps, "memory": memory, "rss_slope": slope, "history": samples,
            "leak_history": samples * 20, "rejection_rate": 0.5, "p99_latency": 1.5, "reporting_pods": 1}


def look(name: str = "svc", pods: tuple[str, ...] = ("svc-a",), ns: str = "ns", slope_pods: Any = None) -> Look:
    return Look(ns, name, GIB, 30, 600, pods, slope_pods)


def test_each_service_gets_its_own_pods_series_only() -> None:
    answers = pod_answers({
        ("ns", "svc", "svc-a"): healthy(memory=GIB * 0.5, skew=3.0),
        ("ns", "svc", "svc-b"): healthy(memory=GIB * 0.6, skew=5.0, steps=4),
        ("ns", "other", "other-a"): healthy(memory=GIB * 0.9, skew=200.0),
        ("ns2", "svc", "svc-a"): healthy(memory=GIB * 0.95, skew=100.0),  # same names, another namespace
    })
    obs = slice_look(URL, answers, look(pods=("svc-a", "svc-b")), NOW)
    assert (obs.skew_ratio, obs.skew_steps, obs.memory_ratio) == (5.0, 14, 0.6)
    assert obs.reporting_pods == ("svc-a", "svc-b") and obs.rejection_rate_per_second == 1.0
    assert obs.p99_latency_seconds == 1.5 and obs.error is None and obs.fully_visible
    other = slice_look(URL, answers, look("other", ("other-a",)), NOW)
    assert (other.skew_ratio, other.memory_ratio) == (200.0, 0.9)


def test_series_of_pods_not_running_now_are_ignored_entirely() -> None:
    """A service re-created under the same name, or a rollout: the old pods' series are still in Prometheus
    (stale or still scraped while they terminate); only the pods the API lists as Running count."""
    answers = pod_answers({
        ("ns", "svc", "svc-old"): healthy(memory=GIB * 0.99, skew=204.0, slope=9e9) | {"leak_history": 999},
        ("ns", "svc", "svc-new"): {"memory": GIB * 0.2, "reporting_pods": 1, "history": 1, "skew_steps": 0,
                                   "skew": "NaN"},
    })
    obs = slice_look(URL, answers, look(pods=("svc-new",)), NOW)
    assert obs.reporting_pods == ("svc-new",) and obs.memory_ratio == 0.2
    assert obs.skew_ratio is None and obs.skew_steps is None  # the new pod's window is not full yet: unknown
    assert obs.skew_unknown_pods == ("svc-new",)
    assert obs.short_history_pods == ("svc-new",) and obs.rss_slope_bytes_per_second is None
    assert not obs.fully_visible
    spec = MoEInferenceServiceSpec.model_validate({})
    d = decide(obs, PolicyState(initial_budgets(spec.batching)), spec, NOW)
    assert d.direction == "hold" and d.pressure == ()  # not tightened at birth by the old pod
    assert "history shorter than 30s in Prometheus for svc-new (1 samples)" in d.reason


def test_an_idle_service_has_no_skew_pressure_and_is_seen() -> None:
    answers = pod_answers({("ns", "svc", "svc-a"): healthy(steps=0, skew="NaN")})
    obs = slice_look(URL, answers, look(), NOW)
    assert obs.skew_ratio is None and obs.skew_steps == 0 and obs.skew_seen and obs.fully_visible


@pytest.mark.parametrize(("steps", "skew"), [(-3, 5.0), (None, 5.0), (7, None)], ids=["reset", "absent", "no-bound"])
def test_skew_of_a_pod_that_cannot_be_counted_is_unknown(steps: float | None, skew: float | None) -> None:
    values = healthy()
    values.pop("skew_steps")
    values.pop("skew")
    values |= ({} if steps is None else {"skew_steps": steps}) | ({} if skew is None else {"skew": skew})
    answers = pod_answers({("ns", "svc", "svc-a"): values, ("ns", "svc", "svc-b"): healthy(skew=9.0)})
    obs = slice_look(URL, answers, look(pods=("svc-a", "svc-b")), NOW)
    assert obs.skew_unknown_pods == ("svc-a",) and obs.skew_ratio == 9.0  # the other pod still tightens
    assert obs.skew_steps == 10 and not obs.skew_seen and not obs.fully_visible


def test_too_little_history_leaves_the_leak_unknown_never_flat() -> None:
    """9 s after Prometheus restarted with its data wiped: 4 samples in a 30 s window, none before it."""
    answers = pod_answers({("ns", "svc", "svc-a"): healthy() | {"leak_history": "NaN", "rss_slope": 0.0}})
    obs = slice_look(URL, answers, look(slope_pods=("svc-a",)), NOW)
    assert obs.rss_slope_bytes_per_second is None
    assert obs.slope_unknown == ("history shorter than 600s in Prometheus for svc-a (no sample before the window) "
                                 f"(needs a sample before the window and at least {MIN_WINDOW_SAMPLES} in it)")
    assert leak_unknown(obs)[0] == "InsufficientHistory" and not obs.fully_visible
    spec = MoEInferenceServiceSpec.model_validate({})
    d = decide(obs, PolicyState(initial_budgets(spec.batching)), spec, NOW)
    assert d.leak is None and d.leak_suspected is None


def test_a_young_pod_out_of_slope_pods_does_not_block() -> None:
    answers = pod_answers({("ns", "svc", "svc-a"): healthy(), ("ns", "svc", "svc-young"): healthy() | {"leak_history": 2}})
    obs = slice_look(URL, answers, look(pods=("svc-a", "svc-young"), slope_pods=("svc-a",)), NOW)
    assert obs.slope_unknown is None and obs.rss_slope_bytes_per_second == 0.0 and obs.fully_visible


def test_windowed_rates_need_every_pod_with_a_full_window() -> None:
    answers = pod_answers({("ns", "svc", "svc-a"): healthy(), ("ns", "svc", "svc-b"): healthy(samples=2)})
    obs = slice_look(URL, answers, look(pods=("svc-a", "svc-b")), NOW)
    assert obs.rejection_rate_per_second is None and obs.p99_latency_seconds is None
    assert obs.short_history_pods == ("svc-b",) and obs.memory_ratio == 0.5


def test_a_series_without_the_grouping_labels_belongs_to_nobody_and_is_named() -> None:
    raw = answer(series("ns", "svc", "svc-a", 1.0), {"metric": {}, "value": [1, "NaN"]})
    got = group_answer(raw)
    assert got.series == (({"namespace": "ns", "moeis": "svc", "pod": "svc-a"}, 1.0),) and got.problem == MALFORMED
    answers = pod_answers({("ns", "svc", "svc-a"): healthy()}) | {"memory": answer({"metric": {}, "value": [1, "NaN"]})}
    obs = slice_look(URL, answers, look(), NOW)
    assert obs.error == "Prometheus at http://prom:9090: PrometheusMalformedAnswer (memory)"
    assert not obs.available


def test_a_blind_query_blinds_the_look() -> None:
    answers = pod_answers({("ns", "svc", "svc-a"): healthy()}) | {"skew": Answer(problem="PrometheusTimeout", blind=True)}
    obs = slice_look(URL, answers, look(), NOW)
    assert obs.error == "Prometheus at http://prom:9090: PrometheusTimeout (skew)"
    assert obs.skew_ratio is None and obs.memory_ratio is None and obs.silent_pods == ("svc-a",)


def test_a_non_finite_memory_is_named() -> None:
    answers = pod_answers({("ns", "svc", "svc-a"): healthy() | {"memory": "NaN"}})
    obs = slice_look(URL, answers, look(), NOW)
    assert obs.memory_ratio is None and obs.error == "memory: non-finite value"


def test_history_rule() -> None:
    assert not history_ok(None) and not history_ok(MIN_WINDOW_SAMPLES - 1) and history_ok(MIN_WINDOW_SAMPLES)


NAMES = st.from_regex(r"[a-z0-9]([a-z0-9.-]{0,10}[a-z0-9])?", fullmatch=True)


@given(st.lists(st.tuples(NAMES, NAMES), min_size=1, max_size=200), st.integers(5, 3600), st.integers(30, 86400))
def test_the_queries_of_a_look_do_not_grow_with_the_services(services: list[tuple[str, str]], w: int, lw: int) -> None:
    """Issue 11 §4: 200 services cost the same number of queries as one (per distinct window pair)."""
    one = queries(services[0][0], services[0][1], w, lw)
    many = queries({ns for ns, _ in services}, {n for _, n in services}, w, lw)
    assert len(vars(many)) == len(vars(one)) == len(Queries.__dataclass_fields__)


@given(st.dictionaries(st.tuples(st.sampled_from(["ns", "ns2"]), st.sampled_from(["svc", "x"]),
                                 st.sampled_from(["p0", "p1", "p2", "p3"])),
                       st.floats(0, 1e12, allow_nan=False), max_size=16),
       st.sets(st.sampled_from(["p0", "p1", "p2", "p3"])))
def test_a_slice_is_exactly_the_service_and_running_pods(values: dict[tuple[str, str, str], float],
                                                         running: set[str]) -> None:
    got = service_slice(answer(*(series(*k, v) for k, v in values.items())), "ns", "svc", running)
    assert {m["pod"]: v for m, v in got.series} == {p: v for (ns, s, p), v in values.items()
                                                     if ns == "ns" and s == "svc" and p in running}


def test_a_target_looks_with_its_spec_windows() -> None:
    spec = MoEInferenceServiceSpec.model_validate({"control": {"windowSeconds": 20, "leakWindowSeconds": 120},
                                                   "resources": {"hardLimit": "2Gi", "softLimit": "1Gi"}})
    t = Target("ns", "svc", spec, ("p0",), (), 2)
    assert t.look() == Look("ns", "svc", 2 * GIB, 20, 120, ("p0",), (), 2)


def test_a_worker_younger_than_the_window_is_read_from_all_its_counts() -> None:
    """A new pod's first skewed batches (no window of history yet), and a restarted container (its counters
    reset inside the window): both are counted from their whole values, at once."""
    new = {"reporting_pods": 1, "memory": GIB / 4, "history": 1, "worker_age": 6.0, "skew_steps_all": 4,
           "skew_all": 64.0}
    restarted = healthy() | {"worker_age": 12.0, "skew_steps": -40, "skew": 3.0, "skew_steps_all": 9,
                             "skew_all": 10.0}
    answers = pod_answers({("ns", "svc", "svc-new"): new, ("ns", "svc", "svc-b"): restarted})
    obs = slice_look(URL, answers, look(pods=("svc-new", "svc-b")), NOW)
    assert (obs.skew_ratio, obs.skew_steps, obs.skew_unknown_pods) == (64.0, 13, ())
    assert obs.short_history_pods == ("svc-new",) and not obs.fully_visible  # rates still need their window
    old = healthy() | {"worker_age": 31.0, "skew_steps_all": 9, "skew_all": 10.0}  # older than the window
    assert slice_look(URL, pod_answers({("ns", "svc", "svc-a"): old}), look(), NOW).skew_ratio == 2.0


def test_the_plan_is_one_set_of_queries_per_window_pair() -> None:
    same = [Look(f"ns{i % 7}", f"svc{i}", GIB, 30, 600, (f"svc{i}-0",), None) for i in range(200)]
    assert len(query_plan(same[:1])) == len(query_plan(same)) == len(Queries.__dataclass_fields__)
    mixed = [*same, Look("ns", "fast", GIB, 10, 60, ("fast-0",), None)]
    plan = query_plan(mixed)
    assert len(plan) == 2 * len(Queries.__dataclass_fields__)
    assert 'moeis="fast"' in plan["memory[10s/60s]"] and "[10s]" in plan["memory[10s/60s]"]
    assert 'moeis=~"svc0|svc1|svc10|' in plan["memory[30s/600s]"]
    assert query_plan([]) == {}


def test_a_look_pins_every_query_to_its_time(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[object] = []

    def fake_fetch_all(url: str, queries: dict[str, str], **kw: object) -> dict[str, object]:
        seen.append(kw.get("at"))
        return {name: read_answer(503, b"down") for name in queries}

    monkeypatch.setattr(observe_mod, "fetch_all", fake_fetch_all)
    observe_looks("http://127.0.0.1:1", [Look("ns", "a", GIB, 30, 600, ("a-0",), None)], NOW)
    assert seen == [NOW]


def test_every_look_of_an_unreachable_prometheus_is_blind() -> None:
    looks = [Look("ns", "a", GIB, 30, 600, ("a-0",), None), Look("ns", "b", GIB, 10, 60, ("b-0",), None)]
    got = observe_looks("http://127.0.0.1:1", looks, NOW)
    assert set(got) == {("ns", "a"), ("ns", "b")}
    for obs in got.values():
        assert obs.error == "Prometheus at http://127.0.0.1:1: PrometheusUnreachable" and not obs.available
    assert observe_looks("http://127.0.0.1:1", [], NOW) == {}


# --- the diagnosis signals (issue 14) ----------------------------------------------------------------------

def diag_answers(**overrides: Answer) -> dict[str, Answer]:
    """Real-shaped answers of the diagnosis queries for pods svc-a and svc-b (and another service's pod)."""
    base = pod_answers({("ns", "svc", "svc-a"): healthy(memory=GIB * 0.9), ("ns", "svc", "svc-b"): healthy(),
                        ("ns", "other", "other-a"): healthy()})
    numbers = {"prefill_batches": 3, "queue_requests": 12, "batches_in_flight": 2, "long_running": 0,
               "long_admitted": 0, "kv_cache_bytes": 2.5e8, "memory_failures": 4, "limit_state": 1,
               "steady_growth_bytes_per_second": 512.0, "mappings_growth_per_second": 0.0}
    diag = [series("ns", "svc", "svc-a", v, signal=k) for k, v in numbers.items()]
    diag += [series("ns", "svc", "svc-b", v, signal=k) for k, v in numbers.items() if k != "long_admitted"]
    diag += [series("ns", "svc", "svc-b", "NaN", signal="gpu_reserved_bytes"),
             series("ns", "other", "other-a", 99, signal="prefill_batches")]
    base.update(
        diag=answer(*diag),
        breakdown=answer(*(series("ns", "svc", "svc-a", v, stage=s) for s, v in
                           (("kv_cache", 2e8), ("attention", 5e7), ("expert_buffers", 6e8), ("dense_mlp", 1e8)))),
        top_share=answer(series("ns", "svc", "svc-a", 0.31, layer="2"), series("ns", "svc", "svc-a", 0.62, layer="7"),
                         series("ns", "svc", "svc-a", 0.2, layer="0")),
        hot_experts=answer(series("ns", "svc", "svc-a", 5e4, layer="7", expert="3")),
        ucx_info=answer(series("ns", "svc", "svc-a", 1, loaded="true", libraries="libucp.so.0,libucs.so.0",
                               mmap_hook_mode="default:bistro", rcache_max_unreleased="default:inf")),
        leak_kinds=answer(series("ns", "svc", "svc-a", 1, kind="native"), series("ns", "svc", "svc-a", 0,
                                                                                  kind="python_heap")),
        growth=answer(series("ns", "svc", "svc-a", 2048, part="rss_anonymous")),
    )
    base.update(overrides)
    return base


def test_the_diagnosis_signals_are_parsed_per_pod_from_real_shaped_answers() -> None:
    obs = slice_look(URL, diag_answers(), look(pods=("svc-a", "svc-b")), NOW)
    assert obs.error is None and obs.signals is not None and obs.signals_missing is None
    a, b = obs.signals.pods
    assert (a.pod, a.memory_bytes, a.prefill_batches, a.queue_requests, a.memory_failures, a.limit_state) == (
        "svc-a", GIB * 0.9, 3, 12, 4, 1)
    assert a.steady_growth_bytes_per_second == 512.0 and a.kv_cache_bytes == 2.5e8
    assert a.stage("expert_buffers") == 6e8 and a.stage("weights") is None
    assert [(t.layer, t.share, t.expert, t.tokens) for t in a.top_layers] == [
        ("7", 0.62, "3", 5e4), ("2", 0.31, None, None), ("0", 0.2, None, None)]
    assert a.ucx is not None and (a.ucx.loaded, a.ucx.mmap_hook_mode, a.ucx.rcache_max_unreleased) == (
        True, "default:bistro", "default:inf")
    assert a.leak_kinds == ("native",) and a.growth == (("rss_anonymous", 2048.0),)
    # svc-b: no long_admitted series (missing, not 0), a NaN GPU figure (no data), no breakdown, no UCX info.
    assert b.long_admitted is None and b.gpu_reserved_bytes is None and b.breakdown == () and b.ucx is None
    assert obs.signals.missing == ("breakdown: svc-b", "long admitted: svc-b", "ucx info: svc-b")


def test_a_young_pods_steady_growth_is_not_read() -> None:
    obs = slice_look(URL, diag_answers(), look(pods=("svc-a", "svc-b"), slope_pods=("svc-b",)), NOW)
    assert obs.signals is not None and obs.signals.pods[0].steady_growth_bytes_per_second is None


@pytest.mark.parametrize("field", ["diag", "breakdown", "top_share", "hot_experts", "ucx_info"])
def test_a_failed_or_malformed_diagnosis_query_leaves_the_signals_missing_not_the_budget_look_blind(field: str) -> None:
    for broken, problem in ((read_answer(503, b"down"), "PrometheusHTTPError 503"),
                            (read_answer(200, b'{"status":"success","data":{"resultType":"vector","result":'
                                              b'[{"metric":{"pod":"x"},"value":[1,"oops"]}]}}'), MALFORMED)):
        obs = slice_look(URL, diag_answers(**{field: broken}), look(pods=("svc-a", "svc-b")), NOW)
        assert obs.signals is None and obs.signals_missing == f"diagnosis queries failed ({field}: {problem})"
        assert obs.error is None and obs.memory_ratio == 0.9  # the budget policy still sees


def test_the_diagnosis_queries_are_few_and_grouped() -> None:
    q = queries("ns", "svc", 30, 600)
    assert len(DIAG_FIELDS) == 5 and len(Queries.__dataclass_fields__) == 23
    for field in DIAG_FIELDS:
        assert "by (namespace, moeis, pod" in getattr(q, field)
    assert steady_growth_steps(30, 600) == (150, 450, 75)
    assert steady_growth_steps(30, 30) == (30, 30, 15)
    assert "min_over_time(deriv(moeguard_process_resident_memory_bytes{namespace=\"ns\",moeis=\"svc\"}[150s])" \
           "[450s:75s])" in q.diag


def test_each_running_pods_memory_model_is_read_from_its_info_labels_and_never_blinds() -> None:
    """Issue 30: ``moeguard_memory_model_info`` per pod; labels that do not parse, a pod with two, an old pod's,
    a failed query: left out (the spec's preset stands in), the budget look still sees."""
    shape = from_model_args(get_preset("small"))
    model = ModelMemory(shape, "bfloat16")
    labels = info_labels(model)
    answers = pod_answers({("ns", "svc", p): healthy() for p in ("svc-a", "svc-b", "svc-c", "svc-old")})
    answers["memory_model"] = answer(
        series("ns", "svc", "svc-a", 1, **labels), series("ns", "svc", "svc-old", 1, **labels),
        series("ns", "svc", "svc-b", 1, **{**labels, "dim": "wide"}),
        series("ns", "svc", "svc-c", 1, **labels), series("ns", "svc", "svc-c", 1, **{**labels, "dtype": "float32"}))
    obs = slice_look(URL, answers, look(pods=("svc-a", "svc-b", "svc-c")), NOW)
    assert obs.memory_models == (("svc-a", model),) and obs.error is None and obs.memory_models_error is None
    answers["memory_model"] = read_answer(503, b"down")
    obs = slice_look(URL, answers, look(pods=("svc-a", "svc-b")), NOW)
    assert obs.memory_models == () and obs.error is None and obs.memory_ratio == 0.5
    assert obs.memory_models_error == "PrometheusHTTPError 503"
    assert "max by (namespace, moeis, pod, n_layer, dim," in queries("ns", "svc", 30, 600).memory_model


def test_the_memory_prediction_inputs_and_the_latency_histograms_are_per_running_pod() -> None:
    """Issue 30: the ``pod_load`` answer gives each pod's idle footprint, correction and context mix; the
    ``latency`` answer's buckets are summed over the Running pods with a full window, per class."""
    answers = pod_answers({("ns", "svc", p): healthy() for p in ("svc-a", "svc-b", "svc-old")})
    load = [series("ns", "svc", "svc-a", v, signal=s) for s, v in (
        ("idle_footprint_bytes", 800 * 2**20), ("correction", 1.3), ("context_max_tokens", 3072),
        ("context_mean_tokens", 700.5))]
    load.append(series("ns", "svc", "svc-b", "NaN", signal="context_mean_tokens"))  # 0 / 0: no request
    answers["pod_load"] = answer(*load)
    hist = [series("ns", "svc", pod, n, histogram=h, priority="interactive", le=le)
            for pod in ("svc-a", "svc-b", "svc-old") for h, le, n in (
                ("ttft", "3.0", 9), ("ttft", "+Inf", 10), ("tpot", "0.25", 10), ("tpot", "+Inf", 10))]
    hist.append(series("ns", "svc", "svc-a", 1, histogram="ttft", priority="batch", le="+Inf"))
    answers["latency"] = answer(*hist)
    obs = slice_look(URL, answers, look(pods=("svc-a", "svc-b")), NOW)
    a, b = obs.pod_loads
    assert (a.pod, a.idle_footprint_bytes, a.correction, a.context_max_tokens, a.context_mean_tokens,
            a.memory_bytes, a.skew_ratio) == ("svc-a", 800 * 2**20, 1.3, 3072, 700.5, GIB / 2, 2.0)
    assert (b.pod, b.idle_footprint_bytes, b.context_mean_tokens) == ("svc-b", None, None)  # no data, never 0
    batch, interactive = obs.latency
    assert interactive.ttft == ((3.0, 18.0), (math.inf, 20.0)) and interactive.tpot == ((0.25, 20.0), (math.inf, 20.0))
    assert batch.priority == "batch" and batch.ttft == ((math.inf, 1.0),) and batch.tpot == ()
    short = pod_answers({("ns", "svc", "svc-a"): healthy(samples=1)})
    short["latency"] = answer(*hist)
    assert slice_look(URL, short, look(pods=("svc-a",)), NOW).latency == ()  # not every pod has a full window


def test_each_pods_own_rss_slope_is_kept_for_the_pods_with_a_full_leak_window() -> None:
    """The leak replacement judges each pod by its own slope (issue 30 item 4); the service-level slope stays the
    highest."""
    answers = pod_answers({("ns", "svc", "svc-a"): healthy(slope=1e6), ("ns", "svc", "svc-b"): healthy(slope=2e5),
                           ("ns", "svc", "svc-young"): healthy(slope=9e9) | {"leak_history": 2}})
    obs = slice_look(URL, answers, look(pods=("svc-a", "svc-b", "svc-young"), slope_pods=("svc-a", "svc-b")), NOW)
    assert obs.pod_rss_slopes == (("svc-a", 1e6), ("svc-b", 2e5)) and obs.rss_slope_bytes_per_second == 1e6


def test_each_running_pods_budget_generation_is_read_and_a_failed_query_never_blinds() -> None:
    """``moeguard_budget_generation`` per reporting pod (the BudgetsApplied condition's input); an old or
    another service's pod is left out; a failed query leaves it unknown and the budget look still sees."""
    answers = pod_answers({("ns", "svc", p): healthy() for p in ("svc-a", "svc-b", "svc-old")}
                          | {("ns", "other", "other-a"): healthy()})
    answers["budget_generation"] = answer(
        series("ns", "svc", "svc-a", 7), series("ns", "svc", "svc-b", -1), series("ns", "svc", "svc-old", 3),
        series("ns", "other", "other-a", 9))
    obs = slice_look(URL, answers, look(pods=("svc-a", "svc-b")), NOW)
    assert obs.budget_generations == (("svc-a", 7.0), ("svc-b", -1.0)) and obs.error is None
    answers["budget_generation"] = read_answer(503, b"down")
    obs = slice_look(URL, answers, look(pods=("svc-a", "svc-b")), NOW)
    assert obs.budget_generations == () and obs.error is None and obs.memory_ratio == 0.5
    assert queries("ns", "svc", 30, 600).budget_generation == (
        'max by (namespace, moeis, pod) (moeguard_budget_generation{namespace="ns",moeis="svc"})')
