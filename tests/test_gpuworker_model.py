"""gpuworker.model / gpuworker.streamed against mlx-lm's own generation, family by family.

The oracle is mlx-lm's `load_model` + `generate_step` on the fully loaded
model (tests/helpers/oracle.py, with its route recorder); ours is
`load_streamed_model` with an in-memory provider whose working bank is exactly
top_k experts, so every prefill needs several waves.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
from mlx_lm.utils import load_model

from gpuworker import streamed
from gpuworker.expert_provider import ExpertProviderError, LeasedWave
from gpuworker.lanes import decode_parts, lane_stream, part_lanes
from gpuworker.model import check_against_store, load_streamed_model, streamed_switches
from gpuworker.slots import slot_arrays
from tests.helpers.models import FAMILIES, write_tiny_model
from tests.helpers.oracle import generate_steps, record_routes, relative_difference

ROOT = Path(__file__).resolve().parents[1]
PROMPT = list(b"The quick brown fox jumps over the lazy dog, again and again.")
GENERATED = 32
RTOL = 1e-4


# ---------------------------------------------------------------------------------------------
# Models and providers


def _experts_of(model) -> dict[int, dict[str, mx.array]]:
    """{layer: {name: stacked [E, ...] array}} of a fully loaded mlx-lm model."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, (SwitchGLU, SwitchMLP)):
            layer = int(re.findall(r"layers\.(\d+)", name)[-1])
            found[layer] = dict(tree_flatten(module.parameters()))
    return found


class Log(list):
    """Ordered events of one test: ('acquire'|'take'|'eval'|'fence', ...)."""


class RecordingWave(LeasedWave):
    __slots__ = ("log", "number", "refs")

    def take(self):
        self.log.append(("take", self.number))
        return super().take()


class RecordingProvider:
    """Serves experts from memory in waves of at most `bank`, and checks the lease discipline."""

    def __init__(self, experts: dict[int, dict[str, mx.array]], *, bank: int, log: Log) -> None:
        self.experts = experts
        self.bank = bank
        self.log = log
        self.calls: list[tuple[int, np.ndarray, int]] = []  # (layer, routes, waves)
        self.outstanding: dict[int, RecordingWave] = {}
        self.fenced: list[int] = []
        self.waves = 0
        self.model = None  # set after loading: fence checks the model holds no wave

    def acquire(self, layer: int, routes: np.ndarray):
        assert not self.outstanding, f"acquire with waves still leased: {list(self.outstanding)}"
        assert routes.ndim == 2 and not routes.flags.writeable
        unique = list(dict.fromkeys(routes.reshape(-1).tolist()))  # first-seen order, not sorted
        waves = []
        for start in range(0, len(unique), self.bank):
            ids = unique[start : start + self.bank]
            tensors = [{name: mx.array(np.array(array[e])) for name, array in self.experts[layer].items()} for e in ids]
            wave = RecordingWave(ids, tensors, lease=self.waves)
            wave.number, wave.log = self.waves, self.log
            wave.refs = [weakref.ref(array) for group in tensors for array in group.values()]
            del tensors
            self.outstanding[wave.number] = wave
            waves.append(wave)
            self.waves += 1
        self.calls.append((layer, routes.copy(), len(waves)))
        self.log.append(("acquire", layer, [wave.number for wave in waves]))
        return waves

    def fence(self, wave: RecordingWave) -> None:
        assert wave.number in self.outstanding, f"fence of wave {wave.number} twice or never leased"
        del self.outstanding[wave.number]
        # Dropped: no Python reference to any array it served is left.
        assert all(ref() is None for ref in wave.refs), f"wave {wave.number} fenced while its arrays live"
        # Evaluated: the last event since this wave's take is an eval of its output.
        since = self.log[self.log.index(("take", wave.number)) + 1 :]
        assert since and since[-1][0] == "eval", f"wave {wave.number} fenced without eval: {since}"
        if self.model is not None:
            for module in streamed_switches(self.model):
                assert not tree_flatten(module.parameters()), "expert parameters left set at fence"
        self.fenced.append(wave.number)
        self.log.append(("fence", wave.number))


@pytest.fixture
def log(monkeypatch) -> Log:
    events = Log()

    def recording_eval(*arrays):
        events.append(("eval", len(arrays)))
        mx.eval(*arrays)

    monkeypatch.setattr(streamed, "_evaluate", recording_eval)
    return events


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made = {}

    def get(family: str, quantized: bool, dtype: str = "float32") -> Path:
        key = (family, quantized, dtype)
        if key not in made:
            made[key] = write_tiny_model(
                tmp_path_factory.mktemp(f"{family}-{int(quantized)}-{dtype}"),
                family=family,
                quantized=quantized,
                dtype=dtype,
            )
        return made[key]

    return get


# ---------------------------------------------------------------------------------------------
# Against mlx-lm, every family, full precision and 4-bit


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "q4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_generation_equals_mlx_lm(family, quantized, models, log):
    path = models(family, quantized)
    oracle, config = load_model(path)
    experts = _experts_of(oracle)
    top_k = config.get("num_experts_per_tok") or config["experts_per_token"]
    provider = RecordingProvider(experts, bank=top_k, log=log)
    model, info = load_streamed_model(path, provider=provider)
    provider.model = model
    oracle_routes = record_routes(oracle)

    # No routed-expert parameter is held, and every sparse layer is streamed.
    held = dict(tree_flatten(model.parameters()))
    assert not [name for name in held if re.search(r"\.(switch_mlp|experts)\.", name)]
    assert info.sparse_layers == tuple(sorted(experts))
    assert info.dense_bytes == sum(array.nbytes for array in held.values())
    full = sum(array.nbytes for _, array in tree_flatten(oracle.parameters()))
    assert info.dense_bytes + info.routed_bytes == full

    # Greedy generation: same tokens, log-probabilities within RTOL.
    want_tokens, want_lp = generate_steps(oracle, PROMPT, GENERATED)
    got_tokens, got_lp = generate_steps(model, PROMPT, GENERATED)
    assert got_tokens == want_tokens
    step_diff = max(relative_difference(a, b) for a, b in zip(want_lp, got_lp))
    assert step_diff <= RTOL
    assert any(waves > 1 for _, _, waves in provider.calls), "prefill never needed several waves"
    # The provider saw every router selection, before dedup: as many as mlx-lm's routers made.
    for layer, seen in oracle_routes.items():
        assert sum(r.size for at, r, _ in provider.calls if at == layer) == sum(r.size for r in seen)

    # Logits of the whole prompt in one forward (multi-wave prefill).
    logits_diff = relative_difference(oracle(mx.array([PROMPT])), model(mx.array([PROMPT])))
    assert logits_diff <= RTOL
    logging.getLogger(__name__).info(
        "%s %s: max relative difference %.3g (steps), %.3g (logits)",
        family,
        "q4" if quantized else "fp32",
        step_diff,
        logits_diff,
    )

    # Lease discipline: each wave fenced exactly once, nothing left leased.
    assert not provider.outstanding
    assert sorted(provider.fenced) == list(range(provider.waves))


@pytest.mark.parametrize("family", FAMILIES)
def test_one_wave_is_bit_identical_and_routes_are_every_selection(family, models, log):
    path = models(family, False)
    oracle, config = load_model(path)
    experts = _experts_of(oracle)
    provider = RecordingProvider(experts, bank=10**6, log=log)
    model, _ = load_streamed_model(path, provider=provider)
    routes = record_routes(oracle)

    ids = mx.array([PROMPT[:40], PROMPT[5:45]])  # batch 2 x 40 tokens: mlx-lm sorts (>= 64 selections)
    want, got = oracle(ids), model(ids)
    assert mx.array_equal(want, got).item()
    top_k = config.get("num_experts_per_tok") or config["experts_per_token"]
    per_layer = {}
    for layer, seen, waves in provider.calls:
        assert waves == 1
        assert seen.shape == (ids.size, top_k)  # every selection, before dedup
        per_layer[layer] = seen
    assert set(per_layer) == set(routes)
    for layer, seen in per_layer.items():
        assert np.array_equal(seen, routes[layer][0])


# ---------------------------------------------------------------------------------------------
# Through the store and a slab: layouts -> slots -> arrays -> streamed module


class SlabProvider:
    """A working bank of `slots` slots: each wave is read into them (plain pread, as an I/O
    worker would) only when the module takes it, which needs the previous wave fenced."""

    def __init__(self, store, *, slots: int) -> None:
        self.store, self.slots = store, slots
        self.buffer = bytearray(slots * store.slot_bytes)
        self.bytes_copied = 0
        self.busy: object = None  # the wave occupying the bank
        self.waves = 0

    def acquire(self, layer, routes):
        unique = sorted(set(routes.reshape(-1).tolist()))
        waves = []
        for start in range(0, len(unique), self.slots):
            ids = unique[start : start + self.slots]
            waves.append(
                LeasedWave(ids, lambda ids=ids, lease=self.waves: self._load(layer, ids, lease), lease=self.waves)
            )
            self.waves += 1
        return waves

    def _load(self, layer, ids, lease):
        assert self.busy is None, f"wave {lease} loaded while wave {self.busy} still holds the bank"
        self.busy = lease
        return [self._read(layer, expert, slot) for slot, expert in enumerate(ids)]

    def _read(self, layer, expert, slot):
        slot_bytes = self.store.slot_bytes
        view = memoryview(self.buffer)[slot * slot_bytes : (slot + 1) * slot_bytes]
        for segment in self.store.locate(layer, expert).segments:
            fd = os.open(self.store.manifest[segment.file], os.O_RDONLY)
            try:
                data = os.pread(fd, segment.length, segment.offset)
            finally:
                os.close(fd)
            view[segment.destination : segment.destination + segment.length] = data
        view.release()
        arrays, stats = slot_arrays(self.buffer, slot, slot_bytes, self.store.layout(layer, expert))
        self.bytes_copied += stats.bytes_copied
        return arrays

    def fence(self, wave):
        assert wave.lease == self.busy, (wave, self.busy)
        self.busy = None
        # The next wave reuses these slots: scribble over them to catch late readers.
        self.buffer[:] = b"\x7f" * len(self.buffer)


# bfloat16 only quantized: MLX's CPU gather_mm (unquantized experts) supports float32 only.
@pytest.mark.parametrize(
    "family,quantized,dtype",
    [
        ("gpt_oss", True, "float32"),
        ("deepseek_v3", False, "float32"),
        ("qwen3_moe", True, "float32"),
        ("mixtral", True, "bfloat16"),
    ],
)
def test_through_store_layouts_and_slots(family, quantized, dtype, models):
    store_module = pytest.importorskip("shared.store")
    path = models(family, quantized, dtype)
    store = store_module.ExpertStore.open(path)
    oracle, config = load_model(path)
    top_k = config.get("num_experts_per_tok") or config["experts_per_token"]
    provider = SlabProvider(store, slots=top_k)
    model, info = load_streamed_model(path, provider=provider)
    check_against_store(info, store)
    ids = mx.array([PROMPT])
    assert mx.array_equal(oracle(ids), model(ids)).item()  # waves reassemble exactly here
    assert provider.bytes_copied > 0 and provider.busy is None and provider.waves > 2 * len(info.modules)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_per_expert_checkpoint_names(family, tmp_path, log):
    """One tensor per expert (HF names): sanitize stacks them; the streamed model still matches."""
    path = write_tiny_model(tmp_path / family, family=family, layout="per_expert")
    oracle, config = load_model(path)
    provider = RecordingProvider(_experts_of(oracle), bank=config["num_experts_per_tok"], log=log)
    model, info = load_streamed_model(path, provider=provider)
    assert not [name for name, _ in tree_flatten(model.parameters()) if ".experts." in name or ".switch_mlp." in name]
    store_module = pytest.importorskip("shared.store")
    check_against_store(info, store_module.ExpertStore.open(path))
    ids = mx.array([PROMPT])
    assert mx.array_equal(oracle(ids), model(ids)).item()
    assert not provider.outstanding


# ---------------------------------------------------------------------------------------------
# Bad providers: clear errors, every wave still fenced, nothing left installed


class BadProvider:
    def __init__(self, experts, *, mode):
        self.experts, self.mode = experts, mode
        self.outstanding: list[LeasedWave] = []
        self.fenced: list[LeasedWave] = []

    def acquire(self, layer, routes):
        unique = sorted(set(routes.reshape(-1).tolist()))
        if self.mode == "missing":
            unique = unique[:-1]
        tensors = [{name: array[e] for name, array in self.experts[layer].items()} for e in unique]
        if self.mode == "shape":
            name = next(iter(tensors[-1]))
            tensors[-1][name] = tensors[-1][name][..., :-1]
        half = len(unique) // 2
        waves = [LeasedWave(unique[:half], tensors[:half]), LeasedWave(unique[half:], tensors[half:])]
        self.outstanding.extend(waves)
        return waves

    def fence(self, wave):
        assert any(wave is w for w in self.outstanding)
        self.outstanding = [w for w in self.outstanding if w is not wave]
        self.fenced.append(wave)


@pytest.mark.parametrize("mode,match", [("missing", "missing"), ("shape", "needs")])
def test_bad_waves_are_refused_and_still_fenced(mode, match, models):
    path = models("qwen3_moe", False)
    oracle, _ = load_model(path)
    provider = BadProvider(_experts_of(oracle), mode=mode)
    model, _ = load_streamed_model(path, provider=provider)
    with pytest.raises(ExpertProviderError, match=match):
        model(mx.array([PROMPT[:8]]))
    assert not provider.outstanding and len(provider.fenced) == 2
    for module in streamed_switches(model):
        assert not tree_flatten(module.parameters())


# ---------------------------------------------------------------------------------------------
# Memory: RSS grows by the dense bytes, not by the experts

_MEASURE = textwrap.dedent(
    """
    import gc, json, sys
    import psutil
    import mlx.core as mx
    import mlx_lm.models.qwen3_moe  # import cost outside the measurement
    from mlx_lm.utils import load_model
    from gpuworker.model import load_streamed_model
    from pathlib import Path

    class Never:
        def acquire(self, layer, routes): raise AssertionError("no forward here")
        def fence(self, wave): raise AssertionError("no forward here")

    mode, path = sys.argv[1], sys.argv[2]
    process = psutil.Process()
    gc.collect()
    before = process.memory_full_info()
    if mode == "streamed":
        model, info = load_streamed_model(path, provider=Never())
        dense = info.dense_bytes
    else:
        model, _ = load_model(Path(path))
        dense = None
    gc.collect()
    after = process.memory_full_info()
    print(json.dumps({"rss": after.rss - before.rss, "uss": after.uss - before.uss, "dense": dense,
                      "active": mx.get_active_memory()}))
    """
)


def _measure(mode: str, path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, mode, str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
def test_loading_reads_dense_bytes_only(layout, tmp_path):
    # Experts: 2 layers x 64 experts x 3 x (128 x 512) fp32 = 96 MiB; dense well under 1 MiB.
    # per_expert: Hugging Face names, stacked by the family's sanitize (lazily, never evaluated).
    path = write_tiny_model(
        tmp_path / "big", family="qwen3_moe", layout=layout, hidden_size=128, moe_intermediate_size=512, num_experts=64
    )
    streamed_run, full_run = _measure("streamed", path), _measure("full", path)
    dense = streamed_run["dense"]
    routed = sum(os.path.getsize(file) for file in path.glob("*.safetensors")) - dense
    assert routed >= 8 * dense and routed >= 64 * 2**20
    margin = 16 * 2**20  # interpreter, allocator and lazy-graph noise
    logging.getLogger(__name__).info(
        "dense %d, routed %d bytes; streamed load %s; full load %s", dense, routed, streamed_run, full_run
    )
    assert streamed_run["rss"] <= dense + margin, (streamed_run, dense)
    assert streamed_run["uss"] <= dense + margin, (streamed_run, dense)
    assert streamed_run["active"] <= dense + 2**20
    # The instrument can see the experts when they are loaded.
    assert full_run["rss"] >= 0.8 * routed, full_run


# ---------------------------------------------------------------------------------------------
# Stacked waves (the lease client's copy path hands the module [n, ...] arrays, no mx.stack)


class StackedProvider:
    """Serves each wave already stacked in ascending expert id, as `LeasedWave(stacked=True)`."""

    def __init__(self, experts: dict[int, dict[str, mx.array]], *, bank: int) -> None:
        self.experts, self.bank = experts, bank
        self.waves = self.fenced = 0

    def acquire(self, layer, routes):
        unique = list(dict.fromkeys(routes.reshape(-1).tolist()))
        waves = []
        for start in range(0, len(unique), self.bank):
            ids = unique[start : start + self.bank]
            ordered = mx.array(sorted(ids))
            tensors = {name: array[ordered] for name, array in self.experts[layer].items()}
            waves.append(LeasedWave(ids, tensors, lease=self.waves, stacked=True))
            self.waves += 1
        return waves

    def fence(self, wave):
        self.fenced += 1


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "q4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_stacked_waves_are_bit_identical(family, quantized, models):
    path = models(family, quantized)
    oracle, config = load_model(path)
    experts = _experts_of(oracle)
    top_k = config.get("num_experts_per_tok") or config["experts_per_token"]
    one_wave = StackedProvider(experts, bank=10**6)
    model, _ = load_streamed_model(path, provider=one_wave)
    ids = mx.array([PROMPT[:40], PROMPT[5:45]])
    assert mx.array_equal(oracle(ids), model(ids)).item()  # one wave: mlx-lm's computation exactly
    want_tokens, want_lp = generate_steps(oracle, PROMPT, GENERATED)
    got_tokens, got_lp = generate_steps(model, PROMPT, GENERATED)
    assert got_tokens == want_tokens
    assert all(mx.array_equal(a, b).item() for a, b in zip(want_lp, got_lp))  # decode: bit for bit
    # A working bank of top_k: prefill in several stacked waves.
    banked = StackedProvider(experts, bank=top_k)
    model, _ = load_streamed_model(path, provider=banked)
    got_tokens, got_lp = generate_steps(model, PROMPT, GENERATED)
    assert got_tokens == want_tokens and max(relative_difference(a, b) for a, b in zip(want_lp, got_lp)) <= RTOL
    assert banked.fenced == banked.waves > len(experts) * (GENERATED + 1)


def test_stacked_wave_of_wrong_shape_is_refused(models):
    path = models("qwen3_moe", True)
    oracle, _ = load_model(path)
    experts = _experts_of(oracle)

    class Short(StackedProvider):
        def acquire(self, layer, routes):
            waves = super().acquire(layer, routes)
            for wave in waves:
                tensors = wave.take()
                name = sorted(tensors)[0]
                tensors[name] = tensors[name][:-1]  # one expert short
                wave._tensors = tensors
            return waves

    provider = Short(experts, bank=10**6)
    model, _ = load_streamed_model(path, provider=provider)
    with pytest.raises(ExpertProviderError, match="stacked"):
        model(mx.array([PROMPT[:8]]))
    assert provider.fenced == provider.waves  # still fenced


class DetachedProvider(StackedProvider):
    """Stacked copies in one reused buffer per layer, as the lease client's pool: detached waves.

    Before rewriting the buffer it checks that the previous wave's outputs were handed over with
    its fence, and evaluates them (what the lease client does)."""

    def __init__(self, experts, *, bank: int) -> None:
        super().__init__(experts, bank=bank)
        self.pending: list[mx.array] = []
        self.async_outputs = 0

    def acquire(self, layer, routes):
        if self.pending:
            mx.eval(*self.pending)
            self.pending.clear()
        waves = super().acquire(layer, routes)
        for wave in waves:
            wave.detached = True
        return waves

    def fence(self, wave):
        assert wave.outputs, "a detached wave is fenced with its outputs"
        self.async_outputs += len(wave.outputs)
        self.pending.extend(wave.outputs)
        super().fence(wave)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_detached_waves_compute_asynchronously_and_stay_bit_identical(family, models, monkeypatch):
    path = models(family, True)
    oracle, _ = load_model(path)
    calls = []
    monkeypatch.setattr(streamed, "_evaluate_async", lambda *a: (calls.append(len(a)), mx.async_eval(*a)))
    provider = DetachedProvider(_experts_of(oracle), bank=10**6)
    model, _ = load_streamed_model(path, provider=provider)
    want_tokens, want_lp = generate_steps(oracle, PROMPT, GENERATED)
    got_tokens, got_lp = generate_steps(model, PROMPT, GENERATED)
    assert got_tokens == want_tokens
    assert all(mx.array_equal(a, b).item() for a, b in zip(want_lp, got_lp))
    assert calls and provider.async_outputs == provider.fenced == provider.waves == len(calls)


class PartedProvider(DetachedProvider):
    """Decode waves in parts (`decode_parts` for `lanes` compute lanes), each stacked in rank order
    when taken, into its own buffer (the lease client's pool sets); prefill waves whole."""

    def __init__(self, experts, *, bank: int, lanes: int = 1) -> None:
        super().__init__(experts, bank=bank)
        self.lanes = lanes
        self.parts_taken: list[tuple[int, int]] = []  # (part index, experts)

    def order(self, ranks: list[int]) -> list[int]:
        """The order the parts take a decode row's experts in (rank order)."""
        return ranks

    def acquire(self, layer, routes):
        waves = super().acquire(layer, routes)
        if routes.shape[0] != 1:
            return waves
        [wave] = waves
        wave.discard()
        ranks = routes.reshape(-1).tolist()
        parts = decode_parts(self.order(ranks), lanes=self.lanes)

        def take_part(index: int) -> dict[str, mx.array]:
            self.parts_taken.append((index, len(parts[index])))
            order = mx.array(list(parts[index]))
            return {name: array[order] for name, array in self.experts[layer].items()}

        return [
            LeasedWave(
                ranks,
                lambda: None,
                lease=wave.lease,
                stacked=True,
                detached=True,
                parts=parts,
                take_part=take_part,
                part_lanes=part_lanes(len(parts), self.lanes),
            )
        ]


@pytest.mark.parametrize("lanes", [1, 2], ids=["1lane", "2lanes"])
@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "q4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_decode_parts_compute_bit_identically(family, quantized, lanes, models, monkeypatch):
    path = models(family, quantized)
    oracle, config = load_model(path)
    top_k = config.get("num_experts_per_tok") or config["experts_per_token"]
    provider = PartedProvider(_experts_of(oracle), bank=10**6, lanes=lanes)
    model, _ = load_streamed_model(path, provider=provider)
    want_tokens, want_lp = generate_steps(oracle, PROMPT, GENERATED)
    used: set[int] = set()

    def recording_lane_stream(lane: int) -> mx.Stream:
        used.add(lane)
        return lane_stream(lane)

    monkeypatch.setattr(streamed, "lane_stream", recording_lane_stream)
    got_tokens, got_lp = generate_steps(model, PROMPT, GENERATED)
    assert got_tokens == want_tokens
    assert all(mx.array_equal(a, b).item() for a, b in zip(want_lp, got_lp))  # bit for bit
    assert used == set(range(lanes))  # the parts ran on every lane (distinct streams: test_lanes)
    sizes = [len(part) for part in decode_parts(range(top_k), lanes=lanes)]
    assert len(sizes) >= 2 and sum(sizes) == top_k
    # Every decode visit took its parts in order, one after the other.
    assert provider.parts_taken[: len(sizes)] == list(enumerate(sizes))
    assert len(provider.parts_taken) % len(sizes) == 0 and provider.fenced == provider.waves


def test_parts_are_checked():
    tensors = {"w": mx.zeros((1, 2))}
    with pytest.raises(ValueError, match="take_part"):
        LeasedWave([1, 2], lambda: None, stacked=True, detached=True, parts=[(1,), (2,)])
    with pytest.raises(ValueError, match="once each"):
        LeasedWave([1, 2], lambda: None, stacked=True, detached=True, parts=[(1,), (1,)], take_part=lambda j: tensors)
    with pytest.raises(ValueError, match="stacked, detached"):
        LeasedWave([1, 2], lambda: None, parts=[(1,), (2,)], take_part=lambda j: tensors)
    wave = LeasedWave(
        [1, 2], lambda: None, stacked=True, detached=True, parts=[(1,), (2,)], take_part=lambda j: tensors
    )
    with pytest.raises(ExpertProviderError, match="out of order"):
        wave.take_part(1)
    assert wave.take_part(0) is tensors
    with pytest.raises(ExpertProviderError, match="already taken"):
        wave.take()  # parts started: the whole wave is no longer there
    assert wave.take_part(1) is tensors and wave.taken


class ReorderedProvider(PartedProvider):
    """Decode parts of the ranks in another order (as a split visit's: resident experts first):
    `reorder` maps a route row's ranks to the order the parts take them in."""

    def __init__(self, experts, *, bank: int, lanes: int, reorder) -> None:
        super().__init__(experts, bank=bank, lanes=lanes)
        self.reorder = reorder
        self.reordered = 0

    def order(self, ranks: list[int]) -> list[int]:
        order = list(self.reorder(ranks))
        self.reordered += order != ranks
        return order


@pytest.mark.parametrize("lanes", [1, 2], ids=["1lane", "2lanes"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_decode_parts_in_any_rank_order_compute_bit_identically(family, lanes, models):
    path = models(family, True)
    oracle, _ = load_model(path)
    want_tokens, want_lp = generate_steps(oracle, PROMPT, GENERATED)
    odd_first = lambda ranks: [e for e in ranks if e % 2] + [e for e in ranks if not e % 2]  # noqa: E731
    for reorder in (lambda ranks: list(reversed(ranks)), odd_first):
        provider = ReorderedProvider(_experts_of(oracle), bank=10**6, lanes=lanes, reorder=reorder)
        model, _ = load_streamed_model(path, provider=provider)
        got_tokens, got_lp = generate_steps(model, PROMPT, GENERATED)
        assert got_tokens == want_tokens
        assert all(mx.array_equal(a, b).item() for a, b in zip(want_lp, got_lp))  # bit for bit
        assert provider.reordered > 0 and provider.fenced == provider.waves


def test_parts_that_are_not_the_route_ranks_are_refused_and_fenced(models):
    path = models("qwen3_moe", True)
    oracle, _ = load_model(path)

    class Shuffled(PartedProvider):
        def acquire(self, layer, routes):
            waves = super().acquire(layer, routes)
            if routes.shape[0] == 1:
                [wave] = waves
                wave.parts = wave.parts[:-1]  # a routed expert in no part
            return waves

        def fence(self, wave):  # refused before any part computed: no outputs to hand over
            StackedProvider.fence(self, wave)

    provider = Shuffled(_experts_of(oracle), bank=10**6)
    model, _ = load_streamed_model(path, provider=provider)
    with pytest.raises(ExpertProviderError, match="not the route's ranks"):
        generate_steps(model, PROMPT, GENERATED)
    assert provider.fenced == provider.waves  # the refused wave was fenced all the same
