"""The one table of routing algorithms: it names the configs' algorithms, and the model, training and the
concurrent schedule follow what it says about each."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.models import tiny_input, tiny_model

import capserve
from capserve.configs import ROUTING_ALGORITHMS
from capserve.routing import attention, dynamic, em
from capserve.routing.losses import training_loss
from capserve.routing.registry import ROUTINGS, update_is_read

# one model per routing algorithm
MODELS = {"attention": "cifar10-simple", "dynamic": "cifar10-simple-dynamic", "em": "cifar10-simple-em"}


def test_the_table_names_every_configs_algorithm():
    assert tuple(ROUTINGS) == ROUTING_ALGORITHMS
    used = {capserve.get_config(name).routing_algorithm for name in capserve.list_models()}
    assert used == set(ROUTINGS)
    assert set(MODELS) == set(ROUTINGS)


@pytest.mark.parametrize("algorithm", ROUTING_ALGORITHMS)
def test_a_model_is_built_from_its_algorithms_entry(algorithm):
    routing, model = ROUTINGS[algorithm], tiny_model(MODELS[algorithm])
    assert type(model.primary) is routing.primary
    assert all(type(layer) is routing.layer for layer in model.capsules)
    assert (model.classifier is not None) == routing.linear_readout
    assert training_loss(model.config) is routing.loss


@pytest.mark.parametrize("algorithm", ROUTING_ALGORITHMS)
@pytest.mark.parametrize("schedule", ["concurrent", "sequential"])
def test_configs_accept_exactly_the_schedules_of_the_table(algorithm, schedule):
    config = capserve.get_config(MODELS[algorithm])
    if schedule in ROUTINGS[algorithm].schedules:
        assert dataclasses.replace(config, routing=schedule).routing == schedule
    else:
        with pytest.raises(ValueError, match="sequential"):
            dataclasses.replace(config, routing=schedule)


@pytest.mark.parametrize("algorithm", ROUTING_ALGORITHMS)
def test_votes_at_the_first_iteration_are_built_only_where_the_table_says(monkeypatch, algorithm):
    """At T = 1 attention and dynamic routing route uniformly from Σ_i v_ij (no vote tensor); EM builds every vote."""
    calls = []
    builders = {
        "attention": (attention, "routing_step"),
        "dynamic": (dynamic, "dynamic_routing"),
        "em": (em, "em_votes"),
    }
    module, name = builders[algorithm]
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args, **kwargs: calls.append(name) or original(*args, **kwargs))
    model = tiny_model(MODELS[algorithm])
    with torch.no_grad():
        model(tiny_input(model, 2), iterations=1)
        assert bool(calls) == ROUTINGS[algorithm].votes_at_first_iteration
        model(tiny_input(model, 2), iterations=2)
        assert calls  # every algorithm builds votes once it routes


def test_an_update_is_read_only_while_it_can_reach_the_logits():
    """Three routed layers, T = 3: layer 2 (the class layer) at every iteration, layer 1 up to t = 2, layer 0 at
    t = 1 only."""
    read = {(i, t) for i in range(3) for t in range(1, 4) if update_is_read(i, t, layers=3, iterations=3)}
    assert read == {(2, 1), (2, 2), (2, 3), (1, 1), (1, 2), (0, 1)}
