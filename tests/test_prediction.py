"""Next-layer prediction on the GPU worker (gpuworker/prediction.py, wired by gpuworker/model.py).

The family's own router is found in every family's MoE block and ranks the
experts that block then picks; a streamed model given a predictor count ranks
the next sparse layer's experts in decode steps only, hands them to its
provider with the layer's routes, and computes exactly what it computed
without them.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
from mlx_lm.utils import load_model

from gpuworker import serve
from gpuworker.expert_provider import LeasedWave
from gpuworker.generate import JobRefused
from gpuworker.model import load_streamed_model, streamed_switches
from gpuworker.prediction import (
    NextLayerRouter,
    PredictingEmbedding,
    PredictionSwitch,
    next_layer_routers,
    router_scores,
)
from shared.gpu_messages import Job, JobError
from tests.helpers.models import FAMILIES, write_tiny_model
from tests.helpers.oracle import generate_steps

PROMPT = list(b"Predict the next layer.")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = write_tiny_model(tmp_path_factory.mktemp(family), family=family)
        return made[family]

    return get


class _Capture(nn.Module):
    """Stands in for a switch: records what its block routed and passes through."""

    def __init__(self, inner: nn.Module, seen: list) -> None:
        super().__init__()
        self.inner, self.seen = inner, seen

    def __call__(self, x, indices):
        self.seen.append((x, indices))
        return self.inner(x, indices)


def _blocks(model: nn.Module) -> dict[int, tuple[nn.Module, str]]:
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, (SwitchGLU, SwitchMLP)):
            *path, key = name.split(".")
            parent = model
            for part in path:
                parent = parent[int(part)] if isinstance(parent, list) else parent[part]
            layer = int(next(part for part in reversed(path) if part.isdigit()))
            found[layer] = (parent, key)
    return found


@pytest.mark.parametrize("family", FAMILIES)
def test_the_familys_own_router_ranks_the_experts_its_block_picks(family, models):
    model, config = load_model(models(family))
    blocks = _blocks(model)
    seen: dict[int, list] = {}
    experts = {}
    for layer, (block, key) in blocks.items():
        switch = block[key]
        experts[layer] = switch.num_experts if hasattr(switch, "num_experts") else None
        seen[layer] = []
        block[key] = _Capture(switch, seen[layer])
    model(mx.array([PROMPT]))
    for layer, (block, _) in blocks.items():
        (x, indices), *_ = seen[layer]
        picked = np.array(indices).reshape(-1, indices.shape[-1])
        num_experts = int(picked.max()) + 1 if experts[layer] is None else experts[layer]
        scores = router_scores(
            block,
            config.get("num_experts")
            or config.get("n_routed_experts")
            or config.get("num_local_experts")
            or num_experts,
        )
        assert scores is not None, f"{family} layer {layer}: no router found"
        ranked = np.argsort(-np.array(scores(x).astype(mx.float32)).reshape(picked.shape[0], -1), axis=-1)
        top = ranked[:, : picked.shape[-1]]
        for row in range(picked.shape[0]):
            assert set(top[row].tolist()) == set(picked[row].tolist()), (family, layer, row)


def test_a_next_layer_router_predicts_best_first_and_unknown_routers_are_skipped():
    linear = nn.Linear(4, 6, bias=False)
    router = NextLayerRouter(layer=3, scores=linear, count=3)
    scores = mx.array([[0.1, 0.9, -1.0, 0.5, 0.8, 0.0]])
    assert router.predict(scores) == (1, 4, 3)
    assert NextLayerRouter(layer=3, scores=linear, count=9).predict(scores) == (1, 4, 3, 0, 5, 2)

    class Block(nn.Module):
        def __init__(self, router: nn.Module | None) -> None:
            super().__init__()
            if router is not None:
                self.gate = router

    routers = next_layer_routers(
        {0: Block(linear), 2: Block(nn.Linear(4, 6)), 5: Block(None), 7: Block(nn.Linear(4, 6))},
        {0: 6, 2: 6, 5: 6, 7: 6},
        count=8,
    )
    assert {layer: (r.layer, r.count) for layer, r in routers.items()} == {0: (2, 6), 5: (7, 6)}  # 2 -> 5 unknown
    assert router_scores(Block(nn.Linear(4, 5)), 6) is None  # a Linear of another size is not the router


class _Provider:
    """Serves every expert from memory in one wave and records what acquire was given."""

    def __init__(self, experts: dict[int, dict[str, mx.array]]) -> None:
        self.experts, self.calls, self.first = experts, [], []

    def prefetch(self, layer, experts) -> None:
        self.first.append((layer, experts, len(self.calls)))

    def acquire(self, layer, routes, *, prefetch=None):
        self.calls.append((layer, routes.shape[0], prefetch))
        ids = list(dict.fromkeys(routes.reshape(-1).tolist()))
        tensors = [{name: array[e] for name, array in self.experts[layer].items()} for e in ids]
        return [LeasedWave(ids, tensors, lease=len(self.calls))]

    def fence(self, wave) -> None:
        pass


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_predicting_streamed_model_computes_the_same_and_predicts_in_decode_only(family, models):
    path = models(family)
    reference, _ = load_model(path)
    experts = {layer: dict(tree_flatten(block[key].parameters())) for layer, (block, key) in _blocks(reference).items()}
    plain, predicting = _Provider(experts), _Provider(experts)
    model, info = load_streamed_model(path, provider=plain)
    model_p, _ = load_streamed_model(path, provider=predicting, predict=5)
    switches = streamed_switches(model_p)
    assert [s.predict.layer if s.predict else None for s in switches] == [*info.sparse_layers[1:], None]
    want = generate_steps(model, PROMPT, 6)
    got = generate_steps(model_p, PROMPT, 6)
    assert want.tokens == got.tokens
    assert all(mx.array_equal(a, b).item() for a, b in zip(want.logprobs, got.logprobs))
    prefill = [call for call in predicting.calls if call[1] > 1]
    decode = [call for call in predicting.calls if call[1] == 1]
    assert prefill and all(call[2] is None for call in prefill)
    # The first sparse layer is predicted from the token, once per decode step, before its routes.
    first = info.sparse_layers[0]
    assert any(isinstance(module, PredictingEmbedding) for _, module in model_p.named_modules())
    decode_steps = [index for index, call in enumerate(predicting.calls) if call[1] == 1 and call[0] == first]
    assert [at for _, _, at in predicting.first] == decode_steps
    assert all(
        layer == first and len(experts) == 5 and len(set(experts)) == 5 for layer, experts, _ in predicting.first
    )
    assert not plain.first and not any(isinstance(m, PredictingEmbedding) for _, m in model.named_modules())
    last = info.sparse_layers[-1]
    for layer, _, prefetch in decode:
        if layer == last:
            assert prefetch is None
        else:
            following = info.sparse_layers[info.sparse_layers.index(layer) + 1]
            assert prefetch[0] == following and len(prefetch[1]) == 5 and len(set(prefetch[1])) == 5


class _StagingProvider(_Provider):
    """Also copies ahead (records what it is asked to stage)."""

    def __init__(self, experts) -> None:
        super().__init__(experts)
        self.staged: list[tuple[int, tuple[int, ...]]] = []

    def copy_ahead_due(self) -> bool:
        return True

    def stage(self, layer, experts) -> None:
        self.staged.append((layer, experts))


@pytest.mark.parametrize("distance", [2, 3])
def test_a_prefetch_distance_predicts_that_many_layers_ahead_and_the_first_ones_from_the_token(distance, tmp_path):
    """Distance d: a decode visit of sparse layer i sends the prediction of layer i+d (none from
    the last d layers), the embedding predicts the first d layers in order before any routes,
    copy ahead's router stays the next layer's, and the tokens are the plain model's."""
    path = write_tiny_model(tmp_path, family="qwen3_moe", num_hidden_layers=5)
    reference, _ = load_model(path)
    experts = {layer: dict(tree_flatten(block[key].parameters())) for layer, (block, key) in _blocks(reference).items()}
    predicting = _StagingProvider(experts)
    model, info = load_streamed_model(path, provider=predicting, predict=4, distance=distance)
    layers = list(info.sparse_layers)
    assert [s.predict.layer if s.predict else None for s in streamed_switches(model)] == [*layers[1:], None]
    got = generate_steps(model, PROMPT, 4)
    assert got.tokens == generate_steps(load_streamed_model(path, provider=_Provider(experts))[0], PROMPT, 4).tokens
    decode = [call for call in predicting.calls if call[1] == 1]
    assert decode and all(call[2] is None for call in predicting.calls if call[1] > 1)
    for layer, _, prefetch in decode:
        index = layers.index(layer)
        if index + distance >= len(layers):
            assert prefetch is None
        else:
            assert prefetch[0] == layers[index + distance] and len(set(prefetch[1])) == 4
    steps = [at for at, call in enumerate(predicting.calls) if call[1] == 1 and call[0] == layers[0]]
    expected = [(first, at) for at in steps for first in layers[:distance]]
    assert [(layer, at) for layer, _, at in predicting.first] == expected
    # copy ahead stages the next layer's experts after each decode visit but the last layer's
    following = [layers[layers.index(visited) + 1] for visited, _, _ in decode if visited != layers[-1]]
    assert [layer for layer, _ in predicting.staged] == following


def test_a_router_that_cannot_take_its_input_stops_predicting_its_layer_and_says_so(tmp_path, caplog):
    """A family whose MoE input is not the router's input (e.g. a latent MoE) must not break decode:
    the layer is no longer predicted, a warning names it, and the output is unchanged."""
    path = write_tiny_model(tmp_path, family="qwen3_moe", num_hidden_layers=3)
    reference, _ = load_model(path)
    experts = {layer: dict(tree_flatten(block[key].parameters())) for layer, (block, key) in _blocks(reference).items()}
    plain, predicting = _Provider(experts), _Provider(experts)
    model, info = load_streamed_model(path, provider=plain)
    model_p, _ = load_streamed_model(path, provider=predicting, predict=4)
    first_switch = streamed_switches(model_p)[0]
    hidden = int(reference.args.hidden_size)
    wrong = nn.Linear(hidden + 3, 8)  # takes a wider input than the MoE block is given
    first_switch.predict = NextLayerRouter(first_switch.predict.layer, wrong, 4)
    embedding = next(module for _, module in model_p.named_modules() if isinstance(module, PredictingEmbedding))
    embedding._predict = type(embedding._predict)(NextLayerRouter(info.sparse_layers[0], wrong, 4), None)
    with caplog.at_level("WARNING", logger="gpuworker.prediction"):
        got = generate_steps(model_p, PROMPT, 4)
    want = generate_steps(model, PROMPT, 4)
    assert want.tokens == got.tokens
    assert first_switch.predict is None and embedding._predict is None
    assert not predicting.first  # the first layer was never predicted
    decode = [call for call in predicting.calls if call[1] == 1]
    first, second, _ = info.sparse_layers
    assert all(prefetch is None for layer, _, prefetch in decode if layer == first)
    assert all(prefetch is not None for layer, _, prefetch in decode if layer == second)  # still predicts
    warned = [r.getMessage() for r in caplog.records if "cannot rank" in r.getMessage()]
    assert sorted(w.split(":")[0] for w in warned) == sorted([f"layer {first}", f"layer {second}"])


def test_a_job_told_not_to_predict_predicts_nothing_and_computes_the_same(tmp_path):
    """The coordinator's `predict=False` (auto paused prefetch) turns the model's one switch off:
    no layer and not the first sends a prediction; turned on again, every decode step predicts."""
    path = write_tiny_model(tmp_path, family="qwen3_moe", num_hidden_layers=3)
    reference, _ = load_model(path)
    experts = {layer: dict(tree_flatten(block[key].parameters())) for layer, (block, key) in _blocks(reference).items()}
    predicting = _Provider(experts)
    model, info = load_streamed_model(path, provider=predicting, predict=4)
    assert info.prediction is not None and info.prediction.on
    want = generate_steps(model, PROMPT, 4)
    info.prediction.on = False
    predicting.calls.clear(), predicting.first.clear()
    got = generate_steps(model, PROMPT, 4)
    assert want.tokens == got.tokens
    assert not predicting.first and all(prefetch is None for _, _, prefetch in predicting.calls)
    info.prediction.on = True
    generate_steps(model, PROMPT, 4)
    assert predicting.first and any(prefetch is not None for _, _, prefetch in predicting.calls)
    _, plain_info = load_streamed_model(path, provider=_Provider(experts))
    assert plain_info.prediction is None


class _Channel:
    def __init__(self) -> None:
        self.sent = []
        self.running: set[int] = set()

    def cancel_requested(self, job_id) -> bool:
        return False

    def send(self, message) -> None:
        self.sent.append(message)

    def job_finished(self, job_id) -> None:
        pass


class _Client:
    def reset_stats(self) -> None:
        pass


def test_the_job_server_sets_the_models_switch_from_each_jobs_predict_flag(monkeypatch):
    """`Job.predict` (the coordinator's auto paused prefetch: False) reaches the model's switch
    before the job's first forward."""
    switch, seen = PredictionSwitch(), []

    def run_job(job, **_):
        seen.append(switch.on)
        raise JobRefused("bad_request", "stop here")  # the rest of serving is not this test's business

    monkeypatch.setattr(serve, "run_job", run_job)
    channel = _Channel()
    info = type("Info", (), {"prediction": switch, "config": {}})()
    server = serve.JobServer(channel, _Client(), None, None, info, type("Args", (), {"prefill_step_size": 8})())
    for job_id, predict in enumerate((False, True, False)):
        server.run(Job(job_id=job_id, prompt_tokens=(1, 2), predict=predict))
    assert seen == [False, True, False]
    assert all(isinstance(message, JobError) for message in channel.sent)
