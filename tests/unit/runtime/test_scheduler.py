from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moeguard_core.contract import Budgets
from moeguard_runtime.engine.scheduler import (
    OverloadPolicy,
    PriorityPolicy,
    QueueLimits,
    Rejected,
    Scheduler,
    prefill_batch_cap,
    priority_class,
    shrink,
)

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def budgets(prefill: int = 100, decode: int = 4, batch: int = 4, batches: int = 1,
            **more: float) -> Budgets:
    return Budgets.model_validate({"max_prefill_tokens": prefill, "max_decode_tokens": decode,
                                   "max_batch_requests": batch, "max_concurrent_batches": batches,
                                   **more})


def make(b: Budgets | None = None, policy: PriorityPolicy | None = None,
         **limits: float) -> tuple[Scheduler, FakeClock]:
    clock = FakeClock()
    return Scheduler(b or budgets(), QueueLimits(**limits), clock,  # type: ignore[arg-type]
                     priority=policy), clock


def test_prefill_budget_admits_in_order_and_head_waits_at_front() -> None:
    s, _ = make(budgets(prefill=100))
    s.submit("a", 60, 5)
    s.submit("b", 50, 5)  # does not fit in the 40 left: waits at the front
    s.submit("c", 10, 5)  # would fit, but may not overtake b
    plan = s.schedule().plan
    assert plan is not None
    assert plan.prefill == (("a", 0, 60),) and plan.admitted == ("a",) and plan.decode == ()
    assert s.queue_requests == 2 and s.queue_tokens == 60
    plan = s.schedule().plan
    assert plan is not None
    assert plan.decode == ("a",)
    assert plan.prefill == (("b", 0, 50), ("c", 0, 10))


def test_chunked_prefill_across_steps_with_decode_alongside() -> None:
    s, _ = make(budgets(prefill=100, decode=4))
    s.submit("short", 10, 5)
    s.schedule()
    s.submit("long", 250, 5)
    p1 = s.schedule().plan
    assert p1 is not None and p1.decode == ("short",) and p1.prefill == (("long", 0, 100),)
    p2 = s.schedule().plan
    assert p2 is not None and p2.prefill == (("long", 100, 100),) and p2.decode == ("short",)
    p3 = s.schedule().plan
    assert p3 is not None and p3.prefill == (("long", 200, 50),)
    p4 = s.schedule().plan
    assert p4 is not None and p4.prefill == () and set(p4.decode) == {"short", "long"}


def test_decode_budget_bounds_sequences_per_step_fairly() -> None:
    s, _ = make(budgets(prefill=1000, decode=2, batch=8))
    for i in range(5):
        s.submit(f"r{i}", 3, 10)
    s.schedule()  # prefill all five
    seen: list[str] = []
    for _ in range(5):
        plan = s.schedule().plan
        assert plan is not None and len(plan.decode) == 2
        seen += plan.decode
    assert {seen.count(f"r{i}") for i in range(5)} == {2}  # everyone decoded twice


def test_batch_request_cap_and_concurrent_batches_round_robin() -> None:
    s, _ = make(budgets(prefill=1000, batch=2, batches=2))
    for i in range(5):
        s.submit(f"r{i}", 5, 5)
    p0 = s.schedule().plan
    p1 = s.schedule().plan
    assert p0 is not None and p1 is not None
    assert (p0.batch, p0.admitted) == (0, ("r0", "r1"))
    assert (p1.batch, p1.admitted) == (1, ("r2", "r3"))
    assert s.running_requests == 4 and s.queue_requests == 1  # r4 waits: both batches full
    p2 = s.schedule().plan
    assert p2 is not None and p2.batch == 0 and p2.admitted == () and p2.decode == ("r0", "r1")
    s.finish("r0")
    p3, p4 = s.schedule().plan, s.schedule().plan
    assert p3 is not None and p3.batch == 1 and p3.admitted == ()
    assert p4 is not None and p4.batch == 0 and p4.admitted == ("r4",)


def test_queue_bounds_and_concurrency_cap_reject_with_reason() -> None:
    s, _ = make(budgets(max_queue_requests=2), max_queue_tokens=100, max_concurrent_requests=3)
    s.submit("a", 60, 1)
    with pytest.raises(Rejected) as exc:
        s.submit("b", 50, 1)
    assert exc.value.reason == "queue_tokens_full" and "max_queue_tokens 100" in exc.value.message
    s.submit("b", 40, 1)
    with pytest.raises(Rejected) as exc:
        s.submit("c", 1, 1)
    assert exc.value.reason == "queue_full"
    s.schedule()  # a and b leave the queue (prefill 100)
    s.submit("c", 1, 1)
    with pytest.raises(Rejected) as exc:
        s.submit("d", 1, 1)
    assert exc.value.reason == "concurrency_limit"
    assert "max_concurrent_requests is 3" in exc.value.message


def test_queue_timeout_with_fake_clock() -> None:
    s, clock = make(budgets(prefill=10, batch=1, queue_timeout_seconds=5.0))
    s.submit("running", 5, 100)
    s.schedule()
    s.submit("w1", 5, 1)
    clock.now += 3
    s.submit("w2", 5, 1)
    clock.now += 2.5  # w1 has waited 5.5 s, w2 2.5 s
    result = s.schedule()
    assert result.expired == ["w1"]
    assert s.queue_requests == 1 and s.queue_tokens == 5
    clock.now += 3
    assert s.schedule().expired == ["w2"]
    assert s.queue_requests == 0 and s.queue_tokens == 0


def test_budget_swap_applies_from_next_step() -> None:
    s, _ = make(budgets(prefill=100))
    s.submit("a", 300, 1)
    p1 = s.schedule().plan
    s.set_budgets(budgets(prefill=30))
    assert s.budgets.max_prefill_tokens == 100  # not yet
    r2 = s.schedule()
    assert p1 is not None and p1.prefill == (("a", 0, 100),)
    assert r2.budgets_applied is not None and r2.budgets_applied.max_prefill_tokens == 30
    assert r2.plan is not None and r2.plan.prefill == (("a", 100, 30),)
    assert r2.plan.budgets.max_prefill_tokens == 30
    assert s.schedule().budgets_applied is None


def test_shrink_factor_scales_budgets_and_restores() -> None:
    s, _ = make(budgets(prefill=100, decode=9, batch=3, batches=2))
    s.set_shrink_factor(0.5)
    s.schedule()
    assert s.budgets == budgets(prefill=50, decode=4, batch=1, batches=2)
    s.set_shrink_factor(1.0)
    s.schedule()
    assert s.budgets == budgets(prefill=100, decode=9, batch=3, batches=2)
    assert shrink(budgets(prefill=1, decode=1, batch=1), 0.1).max_prefill_tokens == 1


def test_finish_is_idempotent_and_frees_queue_tokens() -> None:
    s, _ = make()
    s.submit("a", 500, 1)
    s.finish("a")
    s.finish("a")
    assert s.queue_requests == 0 and s.queue_tokens == 0
    assert s.schedule().plan is None


def test_long_request_cap_per_batch_holds_the_long_head_at_the_front() -> None:
    s, _ = make(budgets(prefill=1000, batch=8, max_long_requests_per_batch=2),
                long_request_threshold_tokens=100)
    for i in range(3):
        s.submit(f"long{i}", 150, 2)
    s.submit("short", 10, 2)
    plan = s.schedule().plan
    assert plan is not None and plan.admitted == ("long0", "long1")  # long2 waits, short behind it
    assert s.queue_requests == 2
    s.finish("long0")
    plan = s.schedule().plan
    assert plan is not None and plan.admitted == ("long2", "short")


def test_prefill_is_capped_more_strictly_than_decode() -> None:
    b = budgets(prefill=50, batch=1, batches=3)
    assert prefill_batch_cap(b) == 2 and prefill_batch_cap(budgets(batches=1)) == 1
    s, _ = make(b)
    for i in range(3):
        s.submit(f"r{i}", 200, 2)  # each needs 4 chunks
    p0 = s.schedule().plan
    p1 = s.schedule().plan
    p2 = s.schedule().plan
    assert p0 is not None and p1 is not None and p2 is not None
    assert p0.admitted == ("r0",) and p1.admitted == ("r1",)
    assert p2.admitted == () and p2.batch == 0  # a third prefilling batch is not opened
    assert s.queue_requests == 1 and len(s.batches) == 2


def test_overload_mode_budgets_context_cap_and_priority() -> None:
    s, _ = make(budgets(prefill=1000, decode=8, batch=1, batches=2))
    s.submit("b1", 10, 5, priority="batch")
    s.submit("i1", 10, 5, priority="interactive")
    s.set_overload(True, OverloadPolicy(max_context_tokens=64))
    with pytest.raises(Rejected) as exc:
        s.submit("big", 60, 10)
    assert exc.value.status == 503 and exc.value.reason == "overload_context_limit"
    assert "must be <= 64 tokens (given 60 + 10 = 70)" in exc.value.message
    plan = s.schedule().plan
    assert plan is not None and plan.admitted == ("i1",)  # interactive first, though it came second
    assert s.budgets.max_concurrent_batches == 1 and s.budgets.max_decode_tokens == 4
    s.set_overload(False)
    s.schedule()
    assert s.budgets == budgets(prefill=1000, decode=8, batch=1, batches=2)
    s.submit("big", 60, 10)  # accepted again


def test_fcfs_policy_is_fifo_without_overload_whatever_the_priority() -> None:
    s, _ = make(budgets(prefill=1000, batch=1), PriorityPolicy("fcfs"))
    s.submit("b1", 10, 5, priority="batch")
    s.submit("i1", 10, 5)
    plan = s.schedule().plan
    assert plan is not None and plan.admitted == ("b1",)
    assert s.schedule().preempted == []  # and never preempts


def test_interactive_first_without_overload() -> None:
    s, _ = make(budgets(prefill=1000, batch=1))
    s.submit("b1", 10, 5, priority="batch")
    s.submit("i1", 10, 5)
    plan = s.schedule().plan
    assert not s.overload and plan is not None and plan.admitted == ("i1",)


def test_queue_length_and_timeout_follow_budget_updates() -> None:
    s, clock = make(budgets(prefill=10, batch=1, max_queue_requests=1, queue_timeout_seconds=100))
    s.submit("running", 5, 100)
    s.schedule()
    s.submit("w1", 5, 1)
    s.set_budgets(budgets(prefill=10, batch=1, max_queue_requests=3, queue_timeout_seconds=2))
    s.submit("w2", 5, 1)  # the new queue length counts at once
    clock.now += 2.5
    assert sorted(s.schedule().expired) == ["w1", "w2"]


def test_interactive_preempts_the_latest_batch_which_resumes_with_its_kv_kept() -> None:
    s, _ = make(budgets(prefill=100, decode=8, batch=2))
    s.submit("b1", 10, 50, priority="batch")
    s.submit("b2", 10, 50, priority="batch")
    plan = s.schedule().plan
    assert plan is not None and plan.admitted == ("b1", "b2")
    s.schedule()  # both decode
    s.submit("i1", 20, 5)
    result = s.schedule()
    assert result.preempted == ["b2"]  # the latest batch arrival
    plan = result.plan
    assert plan is not None and plan.admitted == ("i1",) and plan.prefill == (("i1", 0, 20),)
    assert plan.decode == ()  # a step with interactive work carries no batch tokens (default)
    assert s.counts_by_priority() == {"interactive": {"waiting": 0, "preempted": 0, "running": 1},
                                      "batch": {"waiting": 0, "preempted": 1, "running": 1}}
    assert s.queue_requests == 1 and s.queue_tokens == 0  # its prompt is in its KV cache
    plan = s.schedule().plan
    assert plan is not None and plan.decode == ("i1",)  # b1 waits while i1 runs
    s.finish("i1")
    plan = s.schedule().plan
    assert plan is not None and plan.resumed == ("b2",) and plan.admitted == ()
    assert plan.prefill == () and set(plan.decode) == {"b1", "b2"}  # no recompute: decodes at once
    assert s.counts_by_priority()["batch"] == {"waiting": 0, "preempted": 0, "running": 2}


def test_a_batch_preempted_mid_prefill_resumes_at_its_offset_and_never_expires() -> None:
    s, clock = make(budgets(prefill=100, batch=1, queue_timeout_seconds=5))
    s.submit("b1", 250, 5, priority="batch")
    plan = s.schedule().plan
    assert plan is not None and plan.prefill == (("b1", 0, 100),)
    s.submit("i1", 10, 2)
    result = s.schedule()
    assert result.preempted == ["b1"] and result.plan is not None
    assert result.plan.admitted == ("i1",)
    clock.now += 60  # far past the queue timeout: a preempted request was admitted once
    assert s.schedule().expired == []
    s.finish("i1")
    plan = s.schedule().plan
    assert plan is not None and plan.resumed == ("b1",) and plan.prefill == (("b1", 100, 100),)


def test_batch_runs_only_beside_interactive_within_its_allowance() -> None:
    s, _ = make(budgets(prefill=100, decode=8, batch=8),
                PriorityPolicy(batch_tokens_with_interactive=2))
    for i in range(4):
        s.submit(f"b{i}", 5, 50, priority="batch")
    s.schedule()
    s.submit("i1", 5, 5)
    plan = s.schedule().plan  # i1's prefill, then 2 batch decode tokens
    assert plan is not None and plan.prefill == (("i1", 0, 5),) and len(plan.decode) == 2
    plan = s.schedule().plan
    assert plan is not None and plan.decode[0] == "i1" and len(plan.decode) == 3
    s.finish("i1")
    plan = s.schedule().plan
    assert plan is not None and len(plan.decode) == 4  # no interactive: no limit


def test_a_batch_step_is_capped_at_any_time_and_long_prompts_chunked_to_it() -> None:
    s, _ = make(budgets(prefill=100, decode=8, batch=8), PriorityPolicy(max_batch_step_tokens=16))
    s.submit("b0", 40, 5, priority="batch")
    plans = [s.schedule().plan for _ in range(3)]
    assert [p.prefill for p in plans if p is not None] == [(("b0", 0, 16),), (("b0", 16, 16),),
                                                          (("b0", 32, 8),)]
    s.submit("i0", 40, 5)  # interactive work is never capped
    plan = s.schedule().plan
    assert plan is not None and plan.prefill == (("i0", 0, 40),) and plan.decode == ()


def test_interactive_sheds_the_latest_queued_batch_at_a_full_queue() -> None:
    s, _ = make(budgets(prefill=10, batch=1, max_queue_requests=3))
    s.submit("run", 10, 50, priority="batch")
    s.schedule()
    for i in range(3):
        s.submit(f"q{i}", 5, 5, priority="batch")
    with pytest.raises(Rejected) as exc:
        s.submit("late-batch", 5, 5, priority="batch")  # batch absorbs the refusal
    assert exc.value.reason == "queue_full" and exc.value.status == 429
    assert s.submit("i1", 5, 5) == ["q2"]
    assert s.priority_of("q2") is None and s.queue_requests == 3 and s.queue_tokens == 15
    assert s.submit("i2", 5, 5) == ["q1"]
    assert s.submit("i3", 5, 5) == ["q0"]
    with pytest.raises(Rejected) as exc:  # only interactive left waiting: nothing to shed
        s.submit("i4", 5, 5)
    assert exc.value.reason == "queue_full"


def test_interactive_sheds_a_running_batch_only_at_the_concurrency_cap() -> None:
    s, _ = make(budgets(prefill=100, batch=2), max_concurrent_requests=2)
    s.submit("b1", 10, 50, priority="batch")
    s.submit("b2", 10, 50, priority="batch")
    s.schedule()
    assert s.submit("i1", 10, 5) == ["b2"]  # nothing queued: the latest running batch goes
    assert s.batches == [["b1"]] and s.priority_of("b2") is None
    assert s.submit("i2", 10, 5) == ["b1"]
    with pytest.raises(Rejected) as exc:
        s.submit("i3", 10, 5)
    assert exc.value.reason == "concurrency_limit"


def test_queue_tokens_shed_as_many_batch_requests_as_needed_or_none() -> None:
    s, _ = make(budgets(prefill=10, batch=1), max_queue_tokens=100)
    s.submit("run", 10, 50, priority="batch")
    s.schedule()
    s.submit("q0", 40, 5, priority="batch")
    s.submit("q1", 30, 5, priority="batch")
    s.submit("i0", 20, 5)
    with pytest.raises(Rejected) as exc:  # 90 waiting + 120 > 100 even with every batch gone
        s.submit("i1", 120, 5)
    assert exc.value.reason == "queue_tokens_full"
    assert s.queue_tokens == 90  # nothing was shed for a request still refused
    assert s.submit("i1", 70, 5) == ["q1", "q0"]
    assert s.queue_tokens == 90


def test_fcfs_policy_never_sheds() -> None:
    s, _ = make(budgets(max_queue_requests=1), PriorityPolicy("fcfs"))
    s.submit("b1", 5, 5, priority="batch")
    with pytest.raises(Rejected) as exc:
        s.submit("i1", 5, 5)
    assert exc.value.reason == "queue_full"


def test_preemption_frees_the_prefill_batch_cap_for_interactive() -> None:
    s, _ = make(budgets(prefill=50, batch=1, batches=2))  # one prefilling batch at a time
    s.submit("b1", 200, 5, priority="batch")
    s.schedule()
    s.submit("i1", 10, 5)  # b1's batch is full and a second may not prefill while it does
    result = s.schedule()
    assert result.preempted == ["b1"]
    assert result.plan is not None and result.plan.admitted == ("i1",)
    s2, _ = make(budgets(prefill=50, batch=2, batches=2))
    s2.submit("b1", 200, 5, priority="batch")
    s2.schedule()
    s2.submit("i1", 10, 5)  # room beside b1: joins its batch, nothing preempted
    result = s2.schedule()
    assert result.preempted == [] and result.plan is not None
    assert result.plan.admitted == ("i1",) and result.plan.prefill == (("i1", 0, 10),)


@pytest.mark.parametrize(("given", "expected"), [
    ("interactive", "interactive"), ("batch", "batch"), ("Critical", "interactive"),
    ("STANDARD", "interactive"), ("sheddable", "batch"), (0, "interactive"), (-5, "interactive"),
    (1, "batch"), (10, "batch"), (" 3 ", "batch"), ("-1", "interactive"),
])
def test_priority_class_follows_vllm_and_llm_d(given: str | int, expected: str) -> None:
    assert priority_class(given) == expected


@pytest.mark.parametrize("given", ["urgent", "", "1.5", True, "9" * 30])
def test_priority_class_refuses_anything_else(given: str | int) -> None:
    with pytest.raises(ValueError, match="interactive or batch; a criticality"):
        priority_class(given)


class _Sim:
    """A scheduler driven like the step loop, with a bookkeeping engine: what each request has
    computed and generated, so that every plan can be checked against it."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.computed: dict[str, int] = {}
        self.generated: dict[str, int] = {}
        self.spec: dict[str, tuple[int, int, str]] = {}
        self.ended: set[str] = set()

    def submit(self, req_id: str, prompt: int, max_new: int, priority: str) -> None:
        try:
            shed = self.s.submit(req_id, prompt, max_new, priority)
        except Rejected:
            self.ended.add(req_id)
            return
        assert all(self.spec[v][2] == "batch" and priority == "interactive" for v in shed)
        self.ended.update(shed)
        self.spec[req_id] = (prompt, max_new, priority)
        self.computed[req_id], self.generated[req_id] = 0, 0

    def step(self) -> bool:
        interactive_in = any(self.s.priority_of(r) == "interactive" for r in self.spec
                             if r not in self.ended)
        head = self.s._head()
        result = self.s.schedule()
        self.ended.update(result.expired)
        if (self.s.priority_policy.by_priority and head is not None and head.priority == "interactive"
                and self.s._is_waiting(head)):
            # the head interactive request never waits past a step for a slot that a batch request holds
            assert self.s._has_room(head, self.s.budgets) or (
                self.s.counts_by_priority()["batch"]["running"] == 0)
        plan = result.plan
        if plan is None:
            return False
        ids = [r for r, _, _ in plan.prefill] + list(plan.decode)
        assert len(ids) == len(set(ids)), plan
        assert len(plan.decode) <= plan.budgets.max_decode_tokens
        assert plan.prefill_tokens <= plan.budgets.max_prefill_tokens
        policy = self.s.priority_policy
        batch_tokens = (sum(n for r, _, n in plan.prefill if self.spec[r][2] == "batch")
                        + sum(1 for r in plan.decode if self.spec[r][2] == "batch"))
        if policy.by_priority and interactive_in:
            assert batch_tokens <= policy.batch_tokens_with_interactive, plan
        if policy.by_priority and policy.max_batch_step_tokens is not None:
            assert batch_tokens <= policy.max_batch_step_tokens, plan
        for r, start, n in plan.prefill:
            assert start == self.computed[r] and 0 < n <= self.spec[r][0] - start, (plan, r)
            self.computed[r] += n
        for r in plan.decode:
            assert self.computed[r] >= self.spec[r][0] and self.generated[r] >= 1, (plan, r)
        for r in ids:  # the last prefill chunk and each decode produce a token
            if self.computed[r] >= self.spec[r][0]:
                self.generated[r] += 1
                if self.generated[r] >= self.spec[r][1]:
                    self.s.finish(r)
                    self.ended.add(r)
        return True

    def check(self) -> None:
        live = [r for r in self.spec if r not in self.ended]
        assert sorted(live) == sorted(r for r in self.spec if self.s.priority_of(r) is not None)
        counts = self.s.counts_by_priority()
        assert sum(sum(c.values()) for c in counts.values()) == len(live)
        assert self.s.queue_requests == sum(c["waiting"] + c["preempted"] for c in counts.values())


@given(st.lists(st.tuples(st.sampled_from(["interactive", "batch"]), st.integers(1, 90),
                          st.integers(1, 6), st.integers(0, 3)), max_size=40),
       st.integers(1, 64), st.integers(1, 6), st.integers(1, 4), st.integers(1, 3), st.integers(1, 8),
       st.booleans(), st.integers(0, 3), st.none() | st.integers(1, 20))
def test_no_request_is_lost_and_batch_work_stays_within_its_allowance(
        ops: list[tuple[str, int, int, int]], prefill: int, decode: int, batch: int, batches: int,
        queue: int, fcfs: bool, with_interactive: int, step_cap: int | None) -> None:
    s, _ = make(budgets(prefill=prefill, decode=decode, batch=batch, batches=batches,
                        max_queue_requests=queue, max_long_requests_per_batch=1),
                PriorityPolicy("fcfs" if fcfs else "priority", with_interactive, step_cap),
                max_concurrent_requests=6, max_queue_tokens=200, long_request_threshold_tokens=60)
    sim = _Sim(s)
    for i, (priority, prompt, max_new, steps) in enumerate(ops):
        sim.submit(f"r{i}", prompt, max_new, priority)
        sim.check()
        for _ in range(steps):
            sim.step()
            sim.check()
    for _ in range(2000):  # then every request runs to its end: nothing starves, nothing is stuck
        if not sim.step():
            break
        sim.check()
    assert all(r in sim.ended for r in sim.spec)


@pytest.mark.parametrize(("env", "message"), [
    ({"MOEGUARD_SCHEDULING_POLICY": "lifo"}, "MOEGUARD_SCHEDULING_POLICY='lifo' must be one of priority, fcfs"),
    ({"MOEGUARD_BATCH_TOKENS_WITH_INTERACTIVE": "-1"}, "MOEGUARD_BATCH_TOKENS_WITH_INTERACTIVE=-1 must be >= 0"),
    ({"MOEGUARD_MAX_BATCH_STEP_TOKENS": "lots"}, "MOEGUARD_MAX_BATCH_STEP_TOKENS='lots' is not an integer"),
])
def test_bad_priority_settings_are_refused_at_start_naming_the_variable(env: dict[str, str], message: str) -> None:
    from moeguard_runtime.config import ConfigError, load_settings

    with pytest.raises(ConfigError) as err:
        load_settings(env)
    assert str(err.value) == message


class _KVFit:
    """A memory fit that takes prefill chunks whole and at most ``kv_room`` new KV tokens in all."""

    def __init__(self, kv_room: int) -> None:
        self.kv_room = kv_room

    def add_decode(self, context_tokens: int) -> None:
        pass

    def cap(self, start: int, n: int, new_kv_tokens: int = 0) -> int:
        return n

    def fits_kv(self, new_kv_tokens: int) -> bool:
        return new_kv_tokens <= self.kv_room

    def add(self, start: int, n: int, new_kv_tokens: int = 0) -> None:
        self.kv_room -= new_kv_tokens


def test_a_prefilled_request_is_admitted_without_a_chunk_and_decodes_at_once() -> None:
    s, _ = make(budgets(prefill=100, decode=4))
    s.submit("local", 30, 5)
    s.submit("remote", 500, 5, prefilled=True)  # over the prefill budget: its prompt ran elsewhere
    assert s.queue_tokens == 30  # a prefilled prompt waits as no prefill work
    plan = s.schedule().plan
    assert plan is not None
    assert plan.admitted == ("local", "remote") and plan.prefill == (("local", 0, 30),)
    assert plan.decode == ("remote",)  # its first token came with the KV: it decodes the second now
    plan = s.schedule().plan
    assert plan is not None and set(plan.decode) == {"local", "remote"}


def test_a_prefilled_request_waits_for_room_for_its_kv() -> None:
    s, _ = make(budgets(prefill=100, decode=4))
    s.submit("remote", 50, 10, prefilled=True)
    assert s.schedule(_KVFit(kv_room=59)).plan is None  # 60 tokens of KV arrive at admission
    plan = s.schedule(_KVFit(kv_room=60)).plan
    assert plan is not None and plan.admitted == ("remote",) and plan.decode == ("remote",)
