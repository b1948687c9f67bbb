"""The config object: defaults, YAML, CLI overrides, and errors that name the field."""

import pytest

from dora_ext.config import ConfigError, DoraConfig, InstanceSpec


def test_defaults_and_round_trip():
    cfg = DoraConfig.from_dict({"mode": "dora", "instances": 3, "capacity": 5})
    assert cfg.max_staleness == 2 and cfg.total_capacity == 15
    assert DoraConfig.from_dict(cfg.to_dict()) == cfg


def test_group_size_one_is_sao_single_rollout():
    assert DoraConfig.from_dict({"group_size": 1}).group_size == 1


@pytest.mark.parametrize(
    "data, field, words",
    [
        ({"max_staleness": -1}, "max_staleness", ">= 0"),
        ({"group_size": 0}, "group_size", ">= 1"),
        ({"batch_size": 0}, "batch_size", ">= 1"),
        ({"batch_size": "8"}, "batch_size", "integer"),
        ({"mode": "fast"}, "mode", "sync, one_step_off, partial, pipeline, dora"),
        ({"mode": "sync", "max_staleness": 1}, "max_staleness", "requires max_staleness=0"),
        ({"mode": "pipeline", "max_staleness": 2}, "max_staleness", "requires max_staleness=0"),
        ({"mode": "dora", "max_staleness": 0}, "max_staleness", ">= 1"),
        ({"stalenes": 1}, "stalenes", "accepted keys"),
        ({"instances": 0}, "instances", ">= 1"),
        ({"instances": [{"capacity": 0}]}, "instances[0].capacity", ">= 1"),
        ({"instances": [{"cap": 3}]}, "instances[0]", "capacity"),
        ({"migrate_threshold": 2}, "migrate_threshold", "(0, 1]"),
        ({"max_retries": -1}, "max_retries", ">= 0"),
        ({"max_failed_group_share": 1.5}, "max_failed_group_share", "[0, 1]"),
        ({"max_failed_group_share": "half"}, "max_failed_group_share", "[0, 1]"),
    ],
)
def test_invalid_values_name_the_field_and_the_accepted_values(data, field, words):
    with pytest.raises(ConfigError) as err:
        DoraConfig.from_dict(data)
    assert err.value.field == field
    assert str(err.value).startswith(field + ":")
    assert words in str(err.value)


INTEGER_FIELDS = ["max_staleness", "batch_size", "group_size", "capacity", "max_retries", "max_steps", "elastic_spare"]


@pytest.mark.parametrize("bad", [1.5, 2.0, True, "3", None])
@pytest.mark.parametrize("where", ["instances[1].id", "instances[1].capacity", "instance spec"] + INTEGER_FIELDS)
def test_integer_fields_refuse_floats_bools_and_strings(where, bad):
    """An instance id given as 1.5 became instance 1 (and "3" instance 3, True instance 1, two specs could then
    collide): every integer field takes an int and nothing else, naming the field and what is accepted."""
    from dora_ext.config import InstanceSpec

    data = {"mode": "dora", "elastic": True, "max_staleness": 1}
    if where == "instance spec":  # an InstanceSpec passed in the list is checked as well
        data["instances"] = [InstanceSpec(0, 2), InstanceSpec(bad, 2)]
        field = "instances[1].id"
    elif where.startswith("instances"):
        key = where.rsplit(".", 1)[1]
        data["instances"] = [{"id": 0, "capacity": 2}, {"id": 5, "capacity": 2, key: bad}]
        field = where
    else:
        data[where] = bad
        field = where
    if bad is None and where in ("max_steps",):
        assert DoraConfig.from_dict(data).max_steps is None  # None is its documented "no cap"
        return
    with pytest.raises(ConfigError) as err:
        DoraConfig.from_dict(data)
    assert err.value.field == field, err.value
    assert "expected an integer" in str(err.value) and repr(bad) in str(err.value), err.value


def test_instance_ids_are_non_negative_64_bit_integers():
    for bad in (-1, 2**63):
        with pytest.raises(ConfigError, match=r"^instances\[0\]\.id: expected an integer in \[0, 2\*\*63\)"):
            DoraConfig.from_dict({"instances": [{"id": bad, "capacity": 2}]})
    cfg = DoraConfig.from_dict({"instances": [{"id": 7, "capacity": 2}, {"capacity": 3}]})
    assert [(s.id, s.capacity) for s in cfg.instances] == [(7, 2), (1, 3)]
    assert DoraConfig.from_dict(cfg.to_dict()) == cfg


def test_where_prefixes_the_field_for_host_configs():
    with pytest.raises(ConfigError, match=r"^dora\.max_staleness:"):
        DoraConfig.from_dict({"max_staleness": -2}, where="dora")


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("dora:\n  mode: pipeline\n  batch_size: 4\n  instances: 2\n  capacity: 3\n")
    cfg = DoraConfig.from_yaml(str(p), key="dora")
    assert (cfg.mode, cfg.max_staleness, cfg.batch_size, cfg.total_capacity) == ("pipeline", 0, 4, 6)
    cfg2 = cfg.with_overrides(["mode=dora", "max_staleness=3", "capacity=4"])
    assert (cfg2.mode, cfg2.max_staleness, cfg2.total_capacity) == ("dora", 3, 8)
    with pytest.raises(ConfigError, match="key=value"):
        cfg.with_overrides(["mode"])
    with pytest.raises(ConfigError, match="^bogus:"):
        cfg.with_overrides(["bogus=1"])
    p.write_text("other: {}\n")
    with pytest.raises(ConfigError, match="missing section 'dora'"):
        DoraConfig.from_yaml(str(p), key="dora")


@pytest.mark.parametrize(
    "kw, field, words",
    [
        ({"mode": "dora", "max_staleness": -1}, "max_staleness", ">= 0"),
        ({"mode": "dora", "max_staleness": 0}, "max_staleness", "mode 'dora' requires max_staleness >= 1"),
        ({"mode": "sync", "max_staleness": 2}, "max_staleness", "requires max_staleness=0"),
        ({"mode": "fast"}, "mode", "sync, one_step_off, partial, pipeline, dora"),
        ({"batch_size": 2.0}, "batch_size", "expected an integer >= 1, got 2.0 (float)"),
        ({"group_size": 0}, "group_size", ">= 1"),
        ({"instances": 4}, "instances", "tuple of InstanceSpec"),
        ({"instances": ()}, "instances", "at least one instance"),
        ({"instances": ({"capacity": 2},)}, "instances[0]", "expected an InstanceSpec"),
        ({"instances": (InstanceSpec(0, 0),)}, "instances[0].capacity", ">= 1"),
        ({"instances": (InstanceSpec(0, 2), InstanceSpec(1.5, 2))}, "instances[1].id", "2**63"),
        ({"instances": (InstanceSpec(3, 2), InstanceSpec(3, 2))}, "instances", "unique"),
        ({"max_retries": -1}, "max_retries", ">= 0"),
        ({"max_steps": 0}, "max_steps", ">= 1"),
        ({"migrate": 1}, "migrate", "true or false"),
        ({"migrate_threshold": 0}, "migrate_threshold", "(0, 1]"),
        ({"spread": None}, "spread", "true or false"),
        ({"mode": "partial", "elastic": True}, "elastic", "accepted modes: pipeline, dora"),
        ({"elastic_spare": 1}, "elastic_spare", "needs elastic: true"),
        ({"elastic": True, "elastic_max_lent": 1.0}, "elastic_max_lent", "[0, 1)"),
        ({"max_failed_group_share": True}, "max_failed_group_share", "[0, 1]"),
    ],
)
def test_a_config_built_directly_is_validated_like_from_dict(kw, field, words):
    """`DoraConfig(...)` checked nothing: `DoraConfig(mode="dora", max_staleness=-1)` was accepted and broke later, far
    from the cause. The constructor runs the checks `from_dict` runs (one code path), with the same errors."""
    with pytest.raises(ConfigError) as err:
        DoraConfig(**kw)
    assert err.value.field == field, err.value
    assert str(err.value).startswith(field + ":") and words in str(err.value), err.value


def test_replace_is_validated_and_direct_construction_normalises():
    import dataclasses

    cfg = DoraConfig(mode="pipeline", max_staleness=0, instances=[InstanceSpec(0, 3), InstanceSpec(7, 5)],
                     migrate_threshold=1, max_failed_group_share=0)
    # A list becomes the tuple from_dict builds, an int share a float: equal to the same config
    # built from its dict, and hashable.
    assert cfg.instances == (InstanceSpec(0, 3), InstanceSpec(7, 5))
    assert type(cfg.migrate_threshold) is float and type(cfg.max_failed_group_share) is float
    assert DoraConfig.from_dict(cfg.to_dict()) == cfg and hash(cfg) == hash(DoraConfig.from_dict(cfg.to_dict()))
    assert dataclasses.replace(cfg, max_steps=3).max_steps == 3
    with pytest.raises(ConfigError, match=r"^max_steps: expected an integer >= 1, got 0$"):
        dataclasses.replace(cfg, max_steps=0)
    with pytest.raises(ConfigError, match=r"^max_staleness: mode 'dora' requires max_staleness >= 1"):
        dataclasses.replace(cfg, mode="dora")  # K=0 was pipeline's
    assert DoraConfig() == DoraConfig.from_dict({})  # the defaults agree


def test_from_dict_prefixes_constructor_errors_with_where():
    with pytest.raises(ConfigError) as err:
        DoraConfig.from_dict({"instances": [{"capacity": 2}, {"capacity": 0}]}, where="dora")
    assert err.value.field == "dora.instances[1].capacity"
    assert str(err.value) == "dora.instances[1].capacity: expected an integer >= 1, got 0"
    with pytest.raises(ConfigError, match=r"^dora\.elastic_spare: needs elastic: true"):
        DoraConfig.from_dict({"elastic_spare": 2}, where="dora")


class _Mode(str, __import__("enum").Enum):
    DORA = "dora"


class _K(int, __import__("enum").Enum):
    TWO = 2
    SEVEN = 7


class _Below(int):
    """An int whose comparisons say it is never below anything (its value may be)."""

    def __lt__(self, other):
        return False

    def __le__(self, other):
        return True


class _Between(float):
    def __gt__(self, other):
        return True

    def __lt__(self, other):
        return True

    def __le__(self, other):
        return True

    def __ge__(self, other):
        return True


def test_subclasses_of_str_and_int_are_kept_as_the_plain_values_they_hold():
    """A `(str, Enum)` mode or IntEnum fields were kept as the members: the config printed
    `mode=<_Mode.DORA: 'dora'>`, f-strings gave `_Mode.DORA`, and it did not equal the same
    config from its own `to_dict` through YAML/JSON by type. They become plain str/int."""
    import json

    cfg = DoraConfig(mode=_Mode.DORA, max_staleness=_K.TWO, batch_size=_K.SEVEN, group_size=_K.TWO,
                     instances=(InstanceSpec(_K.SEVEN, _K.TWO),), max_retries=_K.TWO, max_steps=_K.SEVEN)
    assert type(cfg.mode) is str and f"{cfg.mode}" == "dora"
    for name in ("max_staleness", "batch_size", "group_size", "max_retries", "max_steps", "elastic_spare"):
        assert type(getattr(cfg, name)) is int, name
    assert [(type(s.id), type(s.capacity)) for s in cfg.instances] == [(int, int)]
    assert repr(cfg) == repr(DoraConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))))
    assert DoraConfig.from_dict({"mode": _Mode.DORA}).mode.__class__ is str


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"max_staleness": _Below(-1)}, "max_staleness"),
        ({"batch_size": _Below(0)}, "batch_size"),
        ({"instances": (InstanceSpec(_Below(-3), 2),)}, "instances[0].id"),
        ({"instances": (InstanceSpec(0, _Below(0)),)}, "instances[0].capacity"),
        ({"migrate_threshold": _Between(7.0)}, "migrate_threshold"),
        ({"max_failed_group_share": _Between(-1.0)}, "max_failed_group_share"),
    ],
)
def test_a_number_subclass_is_checked_by_the_value_it_holds(kw, field):
    """The range checks compared the object itself, so a subclass whose comparisons are
    overridden passed with an out-of-range value; the value it holds is checked."""
    with pytest.raises(ConfigError) as err:
        DoraConfig(**kw)
    assert err.value.field == field, err.value
