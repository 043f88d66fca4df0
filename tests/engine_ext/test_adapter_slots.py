"""Adapter slots: one row per slot, packed adapters copied in whole, the group and per-module views the
LoRA ops read agreeing with the adapter's own matrices, and nothing stale left behind by eviction."""

import pytest
import torch

from engine_ext.adapter_slots import SCALE_COLUMNS, AdapterSlots, SlotLayout, pack_adapter
from engine_ext.constants import LORA_GROUPS, LORA_MODULES
from engine_ext.lora_adapter import LoRAWeights
from engine_ext.model_config import ModelSpec, RopeSpec

SPEC = ModelSpec(architecture="LlamaForCausalLM", vocab_size=211, hidden_size=64, intermediate_size=112, num_layers=3,
                 num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope=RopeSpec(theta=1e4),
                 tie_word_embeddings=True, max_position_embeddings=256, sliding_windows=(None,) * 3,
                 eos_token_ids=(0,))
R = 8
CPU = torch.device("cpu")


def weights(name: str, ranks: dict[str, int], seed: int, layers=range(3)) -> LoRAWeights:
    """Random A/B for the modules in `ranks` (module -> its rank) on `layers`; scale 1/r plus a module offset."""
    g = torch.Generator().manual_seed(seed)
    shapes = SPEC.module_shapes()
    w = LoRAWeights(name=name, rank=max(ranks.values()))
    for layer in layers:
        for i, (m, r) in enumerate(ranks.items()):
            w.a[(layer, m)] = torch.randn(shapes[m][0], r, generator=g)
            w.b[(layer, m)] = torch.randn(r, shapes[m][1], generator=g)
            w.scale[(layer, m)] = 1.0 / r + i + 10 * layer
    return w


def slots(max_loras: int = 2) -> AdapterSlots:
    return AdapterSlots(SPEC, max_loras, R, torch.float32, CPU)


def load(s: AdapterSlots, w: LoRAWeights, busy=frozenset()) -> int:
    return s.activate(pack_adapter(w, SPEC, torch.float32, pin=False), set(busy))


def assert_slot_holds(s: AdapterSlots, slot: int, w: LoRAWeights) -> None:
    """Every view of `slot` against the adapter: its matrices in place, zeros everywhere else."""
    shapes, R = SPEC.module_shapes(), s.rank  # noqa: N806 - the slots' width, as the module's R
    for layer in range(SPEC.num_layers):
        for g, modules in LORA_GROUPS.items():
            ga, gb, gs = s.group_a[g][layer, slot], s.group_b[g][layer, slot], s.group_scale[g][layer, slot]
            for seg, m in enumerate(modules):
                start = s.group_segments[g][seg]
                a = torch.zeros(shapes[m][0], R)
                b = torch.zeros(R, shapes[m][1])
                if (layer, m) in w.a:
                    r = w.a[(layer, m)].shape[1]
                    a[:, :r], b[:r] = w.a[(layer, m)], w.b[(layer, m)]
                scale = w.scale.get((layer, m), 0.0)
                assert torch.equal(ga[:, seg * R : (seg + 1) * R], a), (layer, m)
                assert torch.equal(gb[:, start : start + shapes[m][1]], b), (layer, m)
                assert gs[seg].item() == pytest.approx(scale)
                assert torch.equal(s.a[m][layer, slot], a) and torch.equal(s.b[m][layer, slot], b)
                assert s.scale[m][layer, slot].item() == pytest.approx(scale)
            # the group's rank bounds every non-zero column of A and row of B: the kernels read no further
            rank = s.group_rank[g][slot].item()
            assert rank == (w.rank if any(m in {mod for _, mod in w.a} for m in modules) else 0), g
            for seg in range(len(modules)):
                assert not ga[:, seg * R + rank : (seg + 1) * R].any()
            assert not gb[rank:].any()


def assert_zero(s: AdapterSlots, slot: int) -> None:
    assert not s.slab[slot].any() and not s.scale_slab[slot].any() and not s.rank_table[slot].any()


ALL = {m: R for m in LORA_MODULES}


@pytest.mark.parametrize("ranks", [
    ALL,  # the packed row is the slot row: one plain copy
    {m: 4 for m in LORA_MODULES},  # lower rank: unpacked into the slot, zero-padded to R
    {"q_proj": 2, "v_proj": 8, "down_proj": 5},  # mixed ranks (rank_pattern), some groups absent
    {"k_proj": 3},
], ids=["full-rank", "rank4", "mixed", "k-only"])
def test_views_hold_the_adapter_after_activate(ranks):
    s = slots()
    w = weights("x", ranks, seed=1)
    slot = load(s, w)
    assert s.table[slot] == "x" and s.ready("x") and not s.loading
    assert_slot_holds(s, slot, w)
    assert_zero(s, s.zero_slot)


def test_view_shapes_strides_and_segments():
    s = slots(max_loras=3)
    L, S, q, kv, inter, h = 3, 4, SPEC.q_size, SPEC.kv_size, SPEC.intermediate_size, SPEC.hidden_size
    expect = {"qkv": (h, 3, q + 2 * kv, (0, q, q + kv)), "o": (q, 1, h, (0,)), "gate_up": (h, 2, 2 * inter, (0, inter)),
              "down": (inter, 1, h, (0,))}
    for g, (fan_in, nseg, out_total, segments) in expect.items():
        assert s.group_a[g].shape == (L, S, fan_in, nseg * R) and s.group_a[g].stride(-1) == 1
        assert s.group_b[g].shape == (L, S, R, out_total) and s.group_b[g].stride(-1) == 1
        assert s.group_scale[g].shape == (L, S, nseg) and s.group_scale[g].dtype == torch.float32
        assert s.group_segments[g] == segments
    for m, (fan_in, fan_out) in SPEC.module_shapes().items():
        assert s.a[m].shape == (L, S, fan_in, R) and s.b[m].shape == (L, S, R, fan_out)
        assert s.scale[m].shape == (L, S)
        for view in (s.a[m], s.b[m]):  # views into the one slab, never copies
            assert view.untyped_storage().data_ptr() == s.slab.untyped_storage().data_ptr()
        assert s.scale[m].untyped_storage().data_ptr() == s.scale_slab.untyped_storage().data_ptr()


def test_reload_of_a_smaller_adapter_into_the_same_slot_leaves_nothing_stale():
    s = slots(max_loras=1)
    big = weights("big", ALL, seed=2)
    small = weights("small", {"q_proj": 2, "gate_proj": 3}, seed=3, layers=[1])
    assert load(s, big) == 0
    assert load(s, small) == 0  # evicts "big": the row is rewritten whole
    assert s.resident == ["small"]
    assert_slot_holds(s, 0, small)
    fresh = slots(max_loras=1)
    load(fresh, small)
    assert torch.equal(s.slab, fresh.slab) and torch.equal(s.scale_slab, fresh.scale_slab)
    assert load(s, big) == 0  # and back: full rank over a partial one
    assert_slot_holds(s, 0, big)


def test_zero_slot_stays_zero_through_loads_and_evictions():
    s = slots(max_loras=2)
    for i in range(5):
        load(s, weights(f"a{i}", {m: 1 + i for m in LORA_MODULES}, seed=i))
        assert_zero(s, s.zero_slot)
    assert len(s.resident) == 2


def test_busy_adapters_stay_and_deactivate_zeroes_the_slot():
    s = slots(max_loras=2)
    load(s, weights("a", ALL, seed=1))
    load(s, weights("b", ALL, seed=2))
    assert not s.can_activate("c", busy={"a", "b"})
    with pytest.raises(RuntimeError, match="no adapter slot"):
        load(s, weights("c", ALL, seed=3), busy={"a", "b"})
    assert load(s, weights("c", ALL, seed=3), busy={"a"}) == 1  # "b" was the evictable one
    assert s.deactivate("a") and s.slot_of("a") is None
    assert_zero(s, 0)
    assert s.deactivate("never-loaded")
    assert load(s, weights("d", {"o_proj": 4}, seed=4)) == 0  # the freed slot is taken first


def test_activate_is_idempotent_and_refuses_too_large_a_rank():
    s = slots(max_loras=2)
    w = weights("x", ALL, seed=1)
    assert load(s, w) == load(s, w) == 0 and s.resident == ["x"]
    with pytest.raises(ValueError, match="does not fit"):
        s.activate(pack_adapter(weights("wide", {"q_proj": 2 * R}, seed=2), SPEC, torch.float32, pin=False), set())


def test_slots_start_narrow_and_grow_for_a_wider_adapter_keeping_the_others():
    s = AdapterSlots(SPEC, 3, 32, torch.float32, CPU, rank=4)
    assert s.rank == 4 and s.generation == 0
    narrow, mixed = weights("narrow", {"q_proj": 2, "o_proj": 4}, seed=1), weights("mixed", {"v_proj": 3}, seed=2)
    assert load(s, narrow) == 0 and load(s, mixed) == 1
    assert s.rank == 4 and s.generation == 0  # they fit: nothing moved
    wide = weights("wide", {"q_proj": 5, "down_proj": 6, "up_proj": 2}, seed=3)
    assert load(s, wide) == 2
    assert s.rank == 8 and s.generation == 1  # the next power of two
    for slot, w in enumerate((narrow, mixed, wide)):
        assert_slot_holds(s, slot, w)
    assert_zero(s, s.zero_slot)
    assert s.width_for(9) == 16 and s.width_for(20) == 32 and s.width_for(8) == 8
    assert load(s, weights("widest", {"k_proj": 20}, seed=4), busy={"narrow", "mixed"}) == 2  # "wide" evicted
    assert s.rank == 32 and s.generation == 2
    assert_slot_holds(s, 0, narrow)
    assert_slot_holds(s, 1, mixed)
    # above max_rank: refused, nothing moved
    with pytest.raises(ValueError, match="does not fit"):
        load(s, weights("too-wide", {"q_proj": 33}, seed=5))
    assert s.rank == 32 and s.generation == 2 and s.resident == ["narrow", "mixed", "widest"]


def test_slots_grown_inside_inference_mode_take_copies_outside_it():
    """The engine's steps run in inference mode and may admit a request (activating its adapter) between a cycle's
    passes: the stacks a growth makes there are written by later copies made outside it."""
    s = AdapterSlots(SPEC, 2, 16, torch.float32, CPU, rank=4)
    wide, narrow = weights("wide", {"q_proj": 8}, seed=1), weights("narrow", {"o_proj": 2}, seed=2)
    with torch.inference_mode():
        load(s, wide)
    assert s.rank == 8 and not s.slab.is_inference()
    load(s, narrow)  # unpacked into its row outside inference mode
    assert_slot_holds(s, 0, wide)
    assert_slot_holds(s, 1, narrow)


def test_a_wider_adapter_that_finds_no_slot_grows_nothing():
    s = AdapterSlots(SPEC, 1, 16, torch.float32, CPU, rank=4)
    load(s, weights("a", {"q_proj": 4}, seed=1))
    with pytest.raises(RuntimeError, match="no adapter slot"):
        load(s, weights("b", {"q_proj": 16}, seed=2), busy={"a"})
    assert s.rank == 4 and s.generation == 0 and s.resident == ["a"]


@pytest.mark.parametrize("ranks,groups", [
    (ALL, tuple(LORA_GROUPS)),
    ({"q_proj": 4, "v_proj": 4}, ("qkv",)),
    ({"o_proj": 2, "down_proj": 6}, ("o", "down")),
])
def test_packed_adapter_holds_only_its_groups_at_its_rank(ranks, groups):
    w = weights("x", ranks, seed=1)
    packed = pack_adapter(w, SPEC, torch.bfloat16, pin=False)
    assert packed.rank == max(ranks.values()) and tuple(packed.layout.blocks) == groups
    assert packed.data.dtype == torch.bfloat16 and packed.scales.shape == (SPEC.num_layers, len(SCALE_COLUMNS))
    shapes = SPEC.module_shapes()
    real = packed.rank * SPEC.num_layers * sum(sum(shapes[m]) for g in groups for m in LORA_GROUPS[g])
    assert real <= packed.data.numel() < real + 2 * 64 * len(groups)  # 128-byte block alignment at most
    assert packed.layout == SlotLayout.build(SPEC, packed.rank, groups)


class _FakeEvent:
    """A CUDA event stand-in: complete once `land()` is called (the copy engine finishing)."""

    issued: list["_FakeEvent"] = []

    def __init__(self):
        self.recorded = self.landed = False

    def record(self, stream=None):
        self.recorded = True
        _FakeEvent.issued.append(self)

    def query(self):
        return self.landed

    def synchronize(self):
        self.landed = True


class _FakeStream:
    def __init__(self):
        self.waited: list[_FakeEvent] = []

    def wait_event(self, event):
        self.waited.append(event)

    def wait_stream(self, stream):
        pass


@pytest.fixture
def deferred(monkeypatch):
    """AdapterSlots on the CPU with its GPU path switched on: a fake copy stream and fake events (the copies
    themselves are real tensor copies), to check the pending/flush bookkeeping without a GPU."""
    import contextlib

    from engine_ext import adapter_slots as mod

    _FakeEvent.issued = []
    monkeypatch.setattr(mod.torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(mod.torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(mod.torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    s = slots(max_loras=1)
    s.copy_stream = _FakeStream()
    return s


def test_a_copy_is_pending_until_flush_then_lands(deferred):
    s = deferred
    w = weights("x", {m: 4 for m in LORA_MODULES}, seed=1)  # lower rank: staged, then unpacked
    slot = load(s, w)
    assert s.slot_of("x") == slot and s._loads[slot].done is None  # taken, nothing issued
    assert_zero(s, slot)
    assert s.loading and not s.ready("x") and not s.deactivate("x")
    assert not s.can_activate("y", busy=set())  # the only slot is loading: not evictable
    s.flush()
    load_ = s._loads[slot]
    assert load_.done is not None and s.copy_stream.waited == [load_.after]  # behind the compute stream's mark
    assert not s.ready("x")  # issued, not landed
    load_.done.landed = True
    assert s.ready("x") and not s.loading
    assert_slot_holds(s, slot, w)
    s.flush()  # nothing pending: a no-op
    assert s.deactivate("x")


def test_synchronize_issues_what_is_pending(deferred):
    s = deferred
    w = weights("x", ALL, seed=2)  # full rank: copied straight into the row
    slot = load(s, w)
    s.synchronize()
    assert s.ready("x") and not s.loading
    assert_slot_holds(s, slot, w)
