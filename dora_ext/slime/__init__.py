"""dora-ext on slime (THUDM/slime): applied by appending flags to a slime launch script.

| slime plug point              | dora-ext                                                  |
|-------------------------------|-----------------------------------------------------------|
| `--rollout-function-path`     | `dora_ext.slime.rollout.generate_rollout` (the scheduler)  |
| `--eval-function-path`        | the same function: slime's eval on the newest version      |
| `--data-source-path`          | `dora_ext.slime.data_source.DoraDataSource` (resumable)    |
| `--custom-config-path`        | the `dora:` / `dora_slime:` YAML (`settings.py`)           |
| `--custom-loss-function-path` | `dora_ext.slime.loss.sao_loss` (SAO double-side mask)      |
| `--use-tis` (`--tis-clip C`)  | correction `tis`: slime's own truncated IS                 |
| `--custom-tis-function-path`  | `dora_ext.slime.loss.staleness_tis` (correction `mask`)    |
| disk weight sync + patch      | `dora_ext.slime.weights.publish_weights` (see patches/)    |

`dora-ext slime-args --config dora.yaml` prints the flags. Importing this package imports
neither slime nor torch; the modules that need them import them where they are used.
"""
