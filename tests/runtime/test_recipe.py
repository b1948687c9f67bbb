"""Recipe validation: every bad value fails before any model is built, naming the field."""

from __future__ import annotations

import glob
import os

import pytest

from dora_ext.config import ConfigError
from dora_ext.runtime.recipe import apply_overrides, load_recipe, recipe_from_dict

from .conftest import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "recipes", "cpu", "*.yaml"))))
def test_shipped_recipes_validate(path):
    recipe = load_recipe(path)
    assert recipe.steps >= 1 and recipe.dora.max_steps == recipe.steps
    for mode in ("sync", "dora"):
        assert recipe.with_mode(mode).dora.mode == mode


def test_default_recipe_is_the_long_tail_task_in_mode_dora():
    recipe = load_recipe(os.path.join(ROOT, "recipes", "cpu", "long-tail.yaml"))
    assert recipe.task_name == "long_tail" and recipe.dora.mode == "dora" and recipe.dora.max_staleness >= 1


@pytest.mark.parametrize(
    "change, field",
    [
        ({"bogus": 1}, "bogus"),
        ({"steps": 0}, "steps"),
        ({"seed": -1}, "seed"),
        ({"name": "a b"}, "name"),
        ({"task": {"name": "chess"}}, "task.name"),
        ({"task": {"median": 0}}, "task.median"),
        ({"task": {"colour": "red"}}, "task.colour"),
        ({"model": {"d_model": 30, "n_head": 4}}, "model.d_model"),
        ({"model": {"depth": 3}}, "model.depth"),
        ({"model": {"type": "gpt5"}}, "model.type"),
        ({"model": {"type": "smollm2"}}, "model.type"),  # long_tail has its own tokenizer
        ({"warm_start": {"lr": -1}}, "warm_start.lr"),
        ({"trainer": {"lr": -0.1}}, "trainer.lr"),
        ({"trainer": {"algorithm": "dpo"}}, "trainer.algorithm"),
        ({"trainer": {"temperature": 0.5}}, "trainer.temperature"),
        ({"trainer": {"learning_rate": 1}}, "trainer.learning_rate"),
        ({"engine": {"temperature": 0}}, "engine.temperature"),
        ({"engine": {"device": "tpu"}}, "engine.device"),
        ({"engine": {"step_s": -0.01}}, "engine.step_s"),
        ({"engine": {"step_s": "fast"}}, "engine.step_s"),
        ({"runtime": {"trainer_cores": 2, "cores": 2}}, "runtime.trainer_cores"),
        ({"runtime": {"cores": 10_000}}, "runtime.cores"),
        ({"runtime": {"backend": "mpi"}}, "runtime.backend"),
        ({"runtime": {"pin": "yes"}}, "runtime.pin"),
        ({"runtime": {"sync_trainer_ranks": 10_000}}, "runtime.sync_trainer_ranks"),
        ({"runtime": {"max_instance_restarts": -1}}, "runtime.max_instance_restarts"),
        ({"runtime": {"max_instance_restarts": 1.5}}, "runtime.max_instance_restarts"),
        ({"runtime": {"trainer_borrow": "yes"}}, "runtime.trainer_borrow"),
        ({"runtime": {"trainer_borrow": True, "backend": "thread"}}, "runtime.trainer_borrow"),
        ({"runtime": {"trainer_borrow": True, "cores": 1}}, "runtime.trainer_borrow"),
        ({"runtime": {"trainer_borrow_nice": 20}}, "runtime.trainer_borrow_nice"),
        ({"runtime": {"trainer_borrow_nice": -1}}, "runtime.trainer_borrow_nice"),
        ({"runtime": {"trainer_borrow_nice": True}}, "runtime.trainer_borrow_nice"),
        ({"trainer": {"ppo_minibatches": 0}}, "trainer.ppo_minibatches"),
        ({"trainer": {"correction": "magic"}}, "trainer.correction"),
        ({"trainer": {"kl_coef": -1}}, "trainer.kl_coef"),
        ({"task": {"style": "roman"}}, "task.style"),
        ({"eval": {"samples": 0}}, "eval.samples"),
        ({"dora": {"mode": "turbo"}}, "dora.mode"),
        ({"dora": {"capacity": 0}}, "dora.capacity"),
        ({"dora": {"max_staleness": 0}}, "dora.max_staleness"),
        ({"dora": {"max_steps": 3}}, "dora.max_steps"),
        ({"dora": {"group_size": 1}}, "dora.group_size"),  # GRPO needs n >= 2
        ({"dora": "fast"}, "dora"),
    ],
)
def test_bad_values_name_their_field(change, field):
    with pytest.raises(ConfigError) as info:
        recipe_from_dict(tiny(**change))
    assert info.value.field == field, str(info.value)
    assert str(info.value).startswith(f"{field}: ")


def test_sao_accepts_single_rollouts():
    recipe = recipe_from_dict(tiny(trainer={"algorithm": "sao"}, dora={"group_size": 1}))
    assert recipe.dora.group_size == 1 and recipe.trainer_config().algorithm == "sao"


def test_with_mode_sets_the_staleness_each_mode_needs():
    recipe = recipe_from_dict(tiny(dora={"max_staleness": 3}))
    assert recipe.with_mode("sync").dora.max_staleness == 0
    assert recipe.with_mode("pipeline").dora.max_staleness == 0
    assert recipe.with_mode("one_step_off").dora.max_staleness == 1
    assert recipe.with_mode("partial").dora.max_staleness == 3
    assert recipe.with_mode("sync").with_mode("dora").dora.max_staleness == 2  # dora's default
    with pytest.raises(ConfigError, match="mode"):
        recipe.with_mode("turbo")
    assert recipe.with_steps(7).dora.max_steps == 7
    # a recipe's admission policy is for the modes that take one: compare runs sync beside it
    ahead = recipe_from_dict(tiny(dora={"admission": "ahead"}))
    assert ahead.with_mode("sync").dora.admission is None and ahead.with_mode("partial").dora.admission == "ahead"
    with pytest.raises(ConfigError, match="dora.admission: mode 'sync'"):
        recipe_from_dict(tiny(dora={"mode": "sync", "max_staleness": 0, "admission": "ahead"}))


def test_overrides_and_file_errors(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("steps: 3\ndora: {capacity: 2}\n")
    recipe = load_recipe(str(path), ["dora.capacity=5", "steps=4", "trainer.lr=0.01"])
    assert recipe.dora.instances[0].capacity == 5 and recipe.steps == 4 and recipe.trainer["lr"] == 0.01
    assert recipe.name == "r"
    with pytest.raises(ConfigError, match="section.key=value"):
        apply_overrides({}, ["dora.capacity"])
    with pytest.raises(ConfigError, match="dora.capacity"):
        load_recipe(str(path), ["dora.capacity=-1"])
    with pytest.raises(ConfigError, match="file not found"):
        load_recipe(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("dora: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_recipe(str(bad))
