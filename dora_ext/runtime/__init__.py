"""The embedded runtime: real torch engines and a real trainer executing the scheduler's actions.

`recipe` (YAML recipes, validated), `runtime` (`prepare`, `Runtime`, `run`, `RunResult`),
`workers` (instance and trainer processes or threads), `report` (metrics lines,
comparison tables, plots), `cli` (`dora-ext train` and `dora-ext compare`). Importing this package
imports torch.
"""

from .recipe import EngineSpec, EvalSpec, ModelSpec, Recipe, RuntimeSpec, WarmStartSpec, load_recipe, recipe_from_dict
from .runtime import Prepared, RunResult, Runtime, RuntimeStall, WorkerDied, evaluate_policy, prepare, run

__all__ = [
    "EngineSpec", "EvalSpec", "ModelSpec", "Prepared", "Recipe", "RunResult", "Runtime", "RuntimeSpec",
    "RuntimeStall", "WarmStartSpec", "WorkerDied", "evaluate_policy", "load_recipe", "prepare", "recipe_from_dict", "run",
]
