from __future__ import annotations

import json
from enum import Enum

import pytest
import torch
from torch import nn

from coreai_opt.config import OP_KINDS, OpConfig, QuantizerConfig, ResolvedSpecs, normalize_module_type
from coreai_opt.quantization.spec import PerBlock, PerChannel, QuantizationScheme, QuantizationSpec

CONV2D = "torch.nn.modules.conv.Conv2d"

W8 = QuantizationSpec(dtype="int8", granularity=PerChannel(axis=0))
W4 = QuantizationSpec(dtype="int4", granularity=PerBlock(axis=1, block_size=32))
W8_CLIP = QuantizationSpec(dtype="int8", qscheme=QuantizationScheme.SYMMETRIC_WITH_CLIPPING)
W16 = QuantizationSpec(dtype="int16", granularity=PerChannel(axis=0))
A8 = QuantizationSpec(dtype="uint8", qscheme=QuantizationScheme.ASYMMETRIC, qparams_calculator="global_minmax")
A16 = QuantizationSpec(dtype="uint16", qscheme=QuantizationScheme.ASYMMETRIC)
A8_SYM = QuantizationSpec(dtype="int8", float_range=(-1.0, 1.0))


class MyConv(nn.Conv2d):
    pass


class MyConvChild(MyConv):
    pass


class NotAModule:
    pass


class Kind(str, Enum):
    CONV = "conv"


def _four_level_config() -> QuantizerConfig:
    return (
        QuantizerConfig(weight=W8, activation=A8)
        .set_op_kind("conv", OpConfig(weight=W4))
        .set_module_type(nn.Conv2d, OpConfig(weight=W16))
        .set_module_name(r"layer1\..*", OpConfig(weight=W8_CLIP))
    )


# ---------------------------------------------------------------------------------------------- OpConfig


def test_opconfig_is_set_when_field_given_as_none_or_spec():
    entry = OpConfig(weight=W8, activation=None)
    assert entry.is_set("weight") and entry.is_set("activation")
    assert entry.activation is None


def test_opconfig_is_set_false_when_field_left_out():
    entry = OpConfig(weight=W8)
    assert entry.is_set("weight")
    assert not entry.is_set("activation")


def test_opconfig_is_set_rejects_unknown_field():
    with pytest.raises(ValueError, match="'bias'"):
        OpConfig().is_set("bias")  # type: ignore[arg-type]


def test_opconfig_equality_distinguishes_none_from_unset():
    assert OpConfig(weight=None) != OpConfig()
    assert OpConfig(weight=None) == OpConfig(weight=None)
    assert hash(OpConfig(weight=W8)) == hash(OpConfig(weight=W8))


def test_opconfig_to_dict_omits_unset_fields_and_keeps_none():
    assert OpConfig(activation=None).to_dict() == {"activation": None}
    assert OpConfig().to_dict() == {}
    assert OpConfig(weight=W8).to_dict() == {"weight": W8.to_dict()}


def test_opconfig_from_dict_round_trip_preserves_set_fields():
    for entry in (OpConfig(), OpConfig(weight=None), OpConfig(weight=W4, activation=A8), OpConfig(activation=A16)):
        rebuilt = OpConfig.from_dict(entry.to_dict())
        assert rebuilt == entry
        assert rebuilt.model_fields_set == entry.model_fields_set


def test_opconfig_from_dict_rejects_unknown_key_naming_it():
    with pytest.raises(ValueError, match=r"unknown key 'wieght'.*activation"):
        OpConfig.from_dict({"wieght": None})


def test_opconfig_accepts_spec_dicts():
    assert OpConfig(weight=W4.to_dict()).weight == W4


def test_opconfig_rejects_non_spec_value_naming_field():
    with pytest.raises(TypeError, match="OpConfig.weight"):
        OpConfig(weight="int8")


def test_opconfig_is_frozen():
    entry = OpConfig(weight=W8)
    with pytest.raises(ValueError):
        entry.weight = W4  # type: ignore[misc]


# ------------------------------------------------------------------------------------------- resolve


def test_resolve_returns_global_when_nothing_matches():
    cfg = _four_level_config()
    assert cfg.resolve("linear", "fc", nn.Linear) == ResolvedSpecs(W8, A8, "global")


def test_resolve_default_config_keeps_everything_float():
    assert QuantizerConfig().resolve("conv", "conv1", nn.Conv2d) == ResolvedSpecs(None, None, "global")


def test_resolve_precedence_module_name_over_type_over_op_kind_over_global():
    cfg = _four_level_config()
    # All four levels match: the module name wins.
    assert cfg.resolve("conv", "layer1.0", nn.Conv2d).weight == W8_CLIP
    assert (
        cfg.resolve("conv", "layer1.0", nn.Conv2d).source
        == "weight from module_name:'layer1\\..*'; activation from global"
    )
    # Name does not match: the module type wins over the op kind.
    assert cfg.resolve("conv", "layer2.0", nn.Conv2d).weight == W16
    # No type match either: the op kind wins over global.
    assert cfg.resolve("conv", "layer2.0", nn.Conv1d).weight == W4
    # Only global remains.
    assert cfg.resolve("linear", "layer2.0", nn.Linear).weight == W8
    # Activations were set only globally, so every case inherits them.
    assert {cfg.resolve("conv", n, t).activation for n, t in [("layer1.0", nn.Conv2d), ("x", nn.Conv1d)]} == {A8}


def test_resolve_source_names_the_single_entry_when_both_fields_come_from_it():
    cfg = QuantizerConfig(weight=W8, activation=A8).set_op_kind("linear", OpConfig(weight=W4, activation=A16))
    assert cfg.resolve("linear", "fc", nn.Linear) == ResolvedSpecs(W4, A16, "op_kind:linear")
    cfg.set_module_type("torch.nn.Linear", OpConfig(weight=W16, activation=None))
    assert cfg.resolve("linear", "fc", nn.Linear) == ResolvedSpecs(
        W16, None, "module_type:torch.nn.modules.linear.Linear"
    )


def test_resolve_resolves_weight_and_activation_independently():
    cfg = (
        QuantizerConfig(weight=W8, activation=A8)
        .set_op_kind("conv", OpConfig(activation=A16))
        .set_module_name("head", OpConfig(weight=W4))
    )
    resolved = cfg.resolve("conv", "head", nn.Conv2d)
    assert resolved == ResolvedSpecs(W4, A16, "weight from module_name:'head'; activation from op_kind:conv")


def test_resolve_none_entry_keeps_everything_float_when_lower_levels_quantize():
    cfg = _four_level_config().set_module_name(r"layer1\.0", None)
    assert cfg.resolve("conv", "layer1.0", nn.Conv2d) == ResolvedSpecs(None, None, "module_name:'layer1\\.0'")
    cfg.set_op_kind("softmax", None)
    assert cfg.resolve("softmax", "attn.softmax", None) == ResolvedSpecs(None, None, "op_kind:softmax")


def test_resolve_explicit_none_field_overrides_lower_spec_while_unset_inherits():
    cfg = QuantizerConfig(weight=W8, activation=A8).set_op_kind("linear", OpConfig(activation=None))
    assert cfg.resolve("linear", "fc", None) == ResolvedSpecs(
        W8, None, "weight from global; activation from op_kind:linear"
    )


def test_resolve_module_name_requires_full_match():
    cfg = (
        QuantizerConfig(weight=W8)
        .set_module_name("conv", OpConfig(weight=W4))
        .set_module_name("layer1", OpConfig(weight=W16))
    )
    assert cfg.resolve("conv", "layer1.conv", None).weight == W8  # "conv" only matches a suffix
    assert cfg.resolve("conv", "conv1", None).weight == W8  # and only a prefix here
    assert cfg.resolve("conv", "layer1.0", None).weight == W8  # "layer1" is only a prefix of "layer1.0"
    assert cfg.resolve("conv", "conv", None).weight == W4
    assert cfg.resolve("conv", "layer1", None).weight == W16


def test_resolve_module_name_none_never_matches_patterns():
    cfg = QuantizerConfig(weight=W8).set_module_name(".*", OpConfig(weight=W4))
    assert cfg.resolve("add", None, None).weight == W8
    assert cfg.resolve("add", "", None).weight == W4


def test_resolve_later_module_name_entry_wins_when_several_match():
    cfg = (
        QuantizerConfig()
        .set_module_name(r"layer1\..*", OpConfig(weight=W4))
        .set_module_name(r"layer1\.0\..*", OpConfig(weight=W16))
    )
    assert cfg.resolve("conv", "layer1.0.conv1", None).weight == W16
    assert cfg.resolve("conv", "layer1.1.conv1", None).weight == W4
    # Setting an existing pattern again moves it last, so the most recent call wins.
    cfg.set_module_name(r"layer1\..*", OpConfig(weight=W8))
    assert list(cfg.module_name) == [r"layer1\.0\..*", r"layer1\..*"]
    assert cfg.resolve("conv", "layer1.0.conv1", None).weight == W8


def test_resolve_later_module_name_entry_only_overrides_the_fields_it_sets():
    cfg = (
        QuantizerConfig()
        .set_module_name(r"layer1\..*", OpConfig(weight=W4, activation=A8))
        .set_module_name(r"layer1\.0", OpConfig(activation=A16))
    )
    assert cfg.resolve("conv", "layer1.0", None) == ResolvedSpecs(
        W4, A16, "weight from module_name:'layer1\\..*'; activation from module_name:'layer1\\.0'"
    )


def test_resolve_module_type_matches_subclasses():
    cfg = QuantizerConfig(weight=W8).set_module_type(nn.Conv2d, OpConfig(weight=W4))
    assert cfg.resolve("conv", "c", MyConvChild) == ResolvedSpecs(
        W4, None, f"weight from module_type:{CONV2D}; activation from global"
    )
    assert cfg.resolve("conv", "c", nn.Conv1d).weight == W8


def test_resolve_module_type_nearest_class_in_mro_wins():
    cfg = (
        QuantizerConfig()
        .set_module_type(MyConv, OpConfig(weight=W16))
        .set_module_type(nn.Conv2d, OpConfig(weight=W4))  # set later, but a base class of MyConv
    )
    assert cfg.resolve("conv", "c", MyConvChild).weight == W16
    assert cfg.resolve("conv", "c", MyConv).weight == W16
    assert cfg.resolve("conv", "c", nn.Conv2d).weight == W4


def test_resolve_accepts_str_enum_op_kind_and_names_its_value():
    cfg = QuantizerConfig(weight=W8).set_op_kind("conv", OpConfig(weight=W4, activation=None))
    assert cfg.resolve(Kind.CONV, "c", None) == ResolvedSpecs(W4, None, "op_kind:conv")


def test_op_kinds_are_exactly_the_kinds_whose_annotation_pattern_applies_the_config():
    from coreai_opt.graph.op_kinds import OpKind
    from coreai_opt.graph.op_patterns import PATTERNS

    configurable = [k.value for k in OpKind if k in PATTERNS and k not in (OpKind.MOVE, OpKind.DROPOUT,
                                                                             OpKind.MAX_POOL)]
    assert list(OP_KINDS) == configurable
    assert OP_KINDS == ("conv", "conv_transpose", "linear", "matmul", "embedding", "add", "mul", "sub", "div", "cat",
                        "layer_norm", "group_norm", "softmax", "gelu", "silu", "hardswish", "sigmoid", "tanh", "relu",
                        "relu6", "hardtanh", "interpolate", "avg_pool")
    relu6 = QuantizationSpec(dtype="uint16", qscheme="asymmetric")
    resolved = QuantizerConfig().set_op_kind("relu6", OpConfig(activation=relu6)).resolve("relu6", None, None)
    assert resolved.activation == relu6 and resolved.source == "weight from global; activation from op_kind:relu6"


def test_op_kind_of_a_value_moving_op_is_rejected_with_the_fix():
    for kind in ("max_pool", "move", "dropout"):
        with pytest.raises(ValueError, match=rf"op kind '{kind}' only moves values and shares its input's "
                                             "quantizer.*configure the op that produces its input"):
            QuantizerConfig().set_op_kind(kind, None)


def test_resolve_rejects_wrong_argument_types():
    cfg = QuantizerConfig()
    with pytest.raises(TypeError, match="module_type"):
        cfg.resolve("conv", "c", nn.Conv2d(1, 1, 1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="module_name"):
        cfg.resolve("conv", 3, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="op_kind"):
        cfg.resolve(None, "c", None)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ keys / validation


def test_module_type_keys_normalise_aliases_and_classes_to_qualified_name():
    assert normalize_module_type("torch.nn.Conv2d") == CONV2D
    assert normalize_module_type(CONV2D) == CONV2D
    assert normalize_module_type(nn.Conv2d) == CONV2D
    cfg = QuantizerConfig(module_type={"torch.nn.Linear": None, nn.Conv2d: OpConfig(weight=W4)})
    assert list(cfg.module_type) == ["torch.nn.modules.linear.Linear", CONV2D]


def test_module_type_aliases_of_one_class_merge_and_later_wins():
    cfg = QuantizerConfig(
        module_type={"torch.nn.Conv2d": OpConfig(weight=W4), nn.Linear: None, CONV2D: OpConfig(weight=W16)}
    )
    assert cfg.module_type == {"torch.nn.modules.linear.Linear": None, CONV2D: OpConfig(weight=W16)}
    assert list(cfg.module_type) == ["torch.nn.modules.linear.Linear", CONV2D]  # the later alias moved last
    cfg.set_module_type("torch.nn.Conv2d", None)
    assert cfg.module_type[CONV2D] is None


def test_module_type_rejects_short_name_with_fix():
    with pytest.raises(ValueError, match=r"'Conv2d'.*torch\.nn\.Conv2d"):
        QuantizerConfig().set_module_type("Conv2d", None)


def test_module_type_rejects_unimportable_name():
    with pytest.raises(ValueError, match="torch.nn.Conv9d"):
        QuantizerConfig(module_type={"torch.nn.Conv9d": None})
    with pytest.raises(ValueError, match="no_such_pkg.Mod"):
        QuantizerConfig(module_type={"no_such_pkg.Mod": None})


def test_module_type_rejects_class_that_is_not_a_module():
    with pytest.raises(TypeError, match="not a torch.nn.Module"):
        QuantizerConfig().set_module_type(NotAModule, None)
    with pytest.raises(TypeError, match="not a torch.nn.Module"):
        QuantizerConfig().set_module_type("torch.Tensor", None)


def test_op_kind_rejects_unknown_kind_naming_it_and_listing_valid_kinds():
    with pytest.raises(ValueError, match=r"unknown op kind 'convolution'.*conv, conv_transpose, linear"):
        QuantizerConfig().set_op_kind("convolution", None)
    with pytest.raises(ValueError, match="'Linear'"):
        QuantizerConfig(op_kind={"Linear": None})


def test_op_kind_accepts_every_listed_kind():
    cfg = QuantizerConfig(op_kind=dict.fromkeys(OP_KINDS))
    assert list(cfg.op_kind) == list(OP_KINDS)
    assert len(OP_KINDS) == 23


def test_module_name_rejects_invalid_regex_naming_it():
    with pytest.raises(ValueError, match=r"'layer\[1'.*not a valid regex"):
        QuantizerConfig().set_module_name("layer[1", None)
    with pytest.raises(ValueError, match=r"'\(a'"):
        QuantizerConfig(module_name={"(a": None})


def test_level_entries_reject_wrong_value_type_naming_key():
    with pytest.raises(TypeError, match=r"op_kind\['conv'\]"):
        QuantizerConfig(op_kind={"conv": W8})


def test_assignment_is_validated():
    cfg = QuantizerConfig()
    with pytest.raises(ValueError, match="'bogus'"):
        cfg.op_kind = {"bogus": None}
    with pytest.raises(ValueError):
        cfg.int32_bias = "yes"  # type: ignore[assignment]


def test_bool_flags_default_true_and_reject_non_bools():
    cfg = QuantizerConfig()
    assert (cfg.int32_bias, cfg.fold_batchnorm, cfg.fixed_range_outputs) == (True, True, True)
    with pytest.raises(ValueError, match="fold_batchnorm"):
        QuantizerConfig(fold_batchnorm=1)  # type: ignore[arg-type]


def test_constructor_rejects_unknown_field():
    with pytest.raises(ValueError, match="weights"):
        QuantizerConfig(weights=W8)  # type: ignore[call-arg]


# ------------------------------------------------------------------------------------------- setters


def test_setters_mutate_in_place_and_return_self():
    cfg = QuantizerConfig()
    assert cfg.set_global(weight=W8) is cfg
    assert cfg.set_op_kind("linear", None) is cfg
    assert cfg.set_module_type(nn.Linear, None) is cfg
    assert cfg.set_module_name("fc", None) is cfg
    assert cfg.weight == W8
    assert cfg.op_kind == {"linear": None}
    assert cfg.module_type == {"torch.nn.modules.linear.Linear": None}
    assert cfg.module_name == {"fc": None}


def test_set_global_changes_only_given_fields():
    cfg = QuantizerConfig(weight=W8, activation=A8)
    cfg.set_global(activation=None)
    assert (cfg.weight, cfg.activation) == (W8, None)
    cfg.set_global(weight=W4)
    assert (cfg.weight, cfg.activation) == (W4, None)


def test_set_global_validates_value():
    with pytest.raises(TypeError, match="QuantizerConfig.weight"):
        QuantizerConfig().set_global(weight=8)  # type: ignore[arg-type]


def test_model_copy_deep_gives_independent_config():
    cfg = _four_level_config()
    copy = cfg.model_copy(deep=True)
    copy.set_op_kind("linear", None)
    assert "linear" not in cfg.op_kind


# ------------------------------------------------------------------------------ unused module patterns


def test_unused_module_name_patterns_returns_patterns_matching_no_name():
    cfg = (
        QuantizerConfig()
        .set_module_name(r"layer1\..*", None)
        .set_module_name("conv", None)
        .set_module_name("head", None)
    )
    names = (n for n in ["", "conv1", "layer1.0", "layer1.0.conv1", "fc"])
    assert cfg.unused_module_name_patterns(names) == ["conv", "head"]


def test_unused_module_name_patterns_rejects_a_single_string():
    with pytest.raises(TypeError, match="iterable of module names"):
        QuantizerConfig().set_module_name("a", None).unused_module_name_patterns("a")


# --------------------------------------------------------------------------------------- serialisation


def _full_config() -> QuantizerConfig:
    return (
        _four_level_config()
        .set_op_kind("softmax", None)
        .set_op_kind("linear", OpConfig(activation=None))
        .set_module_type(MyConv, OpConfig())
        .set_module_name("head", OpConfig(weight=None, activation=A8_SYM))
        .set_module_name("a|b", None)
        .model_copy(update={"int32_bias": False, "fixed_range_outputs": False})
    )


def test_to_dict_layout_is_plain_and_json_serialisable():
    data = _full_config().to_dict()
    assert list(data) == [
        "weight",
        "activation",
        "op_kind",
        "module_type",
        "module_name",
        "int32_bias",
        "fold_batchnorm",
        "fold_attention_scale",
        "fold_channel_scales",
        "fixed_range_outputs",
        "per_block_fallback",
        "kv_cache",
    ]
    assert data["kv_cache"] is None
    assert data["op_kind"]["softmax"] is None
    assert data["op_kind"]["linear"] == {"activation": None}
    assert data["module_type"][f"{MyConv.__module__}.MyConv"] == {}
    assert data["module_name"]["head"]["activation"]["float_range"] == [-1.0, 1.0]
    assert json.loads(json.dumps(data)) == data


def test_dict_round_trip_gives_equal_config_with_same_order():
    cfg = _full_config()
    rebuilt = QuantizerConfig.from_dict(cfg.to_dict())
    assert rebuilt == cfg
    assert rebuilt.to_dict() == cfg.to_dict()
    assert list(rebuilt.module_name) == list(cfg.module_name)
    assert rebuilt.module_name["head"].model_fields_set == {"weight", "activation"}
    assert rebuilt.op_kind["linear"].model_fields_set == {"activation"}


def test_yaml_round_trip_from_text():
    cfg = _full_config()
    text = cfg.to_yaml()
    assert text.index("op_kind") < text.index("module_name")  # key order kept
    assert QuantizerConfig.from_yaml(text) == cfg


def test_yaml_round_trip_from_file_path(tmp_path):
    cfg = _full_config()
    path = tmp_path / "cfg.yaml"
    path.write_text(cfg.to_yaml(), encoding="utf-8")
    assert QuantizerConfig.from_yaml(path) == cfg
    assert QuantizerConfig.from_yaml(str(path)) == cfg


def test_from_yaml_handwritten_document():
    text = """
weight: {dtype: int8, granularity: {type: per_channel, axis: 0}}
activation: {dtype: uint8, qscheme: asymmetric, qparams_calculator: global_minmax}
op_kind:
  softmax: null
  linear: {activation: null}
module_type:
  torch.nn.Conv2d: {weight: {dtype: int4, granularity: {type: per_block, axis: 1, block_size: 32}}}
module_name:
  'layer1\\..*': {weight: null}
fold_batchnorm: false
"""
    cfg = QuantizerConfig.from_yaml(text)
    assert (cfg.weight, cfg.activation) == (W8, A8)
    assert cfg.fold_batchnorm is False and cfg.int32_bias is True
    assert cfg.resolve("conv", "stem", nn.Conv2d) == ResolvedSpecs(
        W4, A8, f"weight from module_type:{CONV2D}; activation from global"
    )
    assert cfg.resolve("conv", "layer1.0", nn.Conv2d) == ResolvedSpecs(
        None, A8, "weight from module_name:'layer1\\..*'; activation from global"
    )
    assert cfg.resolve("linear", "fc", nn.Linear) == ResolvedSpecs(
        W8, None, "weight from global; activation from op_kind:linear"
    )


def test_from_yaml_missing_file_raises():
    with pytest.raises(FileNotFoundError):
        QuantizerConfig.from_yaml("/nonexistent/dir/cfg.yaml")


def test_from_yaml_rejects_non_mapping_document():
    with pytest.raises(TypeError, match="mapping"):
        QuantizerConfig.from_yaml("- a\n- b\n")
    with pytest.raises(TypeError, match="mapping"):
        QuantizerConfig.from_yaml("")


def test_from_dict_rejects_unknown_top_level_key_listing_valid_keys():
    with pytest.raises(ValueError, match=r"unknown key 'quantization_config'.*weight, activation, op_kind"):
        QuantizerConfig.from_dict({"quantization_config": {}})


def test_from_dict_rejects_unknown_key_inside_entry_naming_entry_and_key():
    with pytest.raises(ValueError, match=r"module_name\['fc'\].*unknown key 'activations'"):
        QuantizerConfig.from_dict({"module_name": {"fc": {"activations": None}}})


def test_from_dict_rejects_unknown_key_inside_spec_naming_it():
    with pytest.raises(ValueError, match=r"op_kind\['conv'\].*dtyp"):
        QuantizerConfig.from_dict({"op_kind": {"conv": {"weight": {"dtyp": "int8"}}}})
    with pytest.raises(ValueError, match=r"QuantizerConfig.activation.*bits"):
        QuantizerConfig.from_dict({"activation": {"dtype": "uint8", "bits": 8}})


def test_from_dict_rejects_non_mapping():
    with pytest.raises(TypeError, match="must be a dict"):
        QuantizerConfig.from_dict([("weight", None)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="op_kind must be a dict"):
        QuantizerConfig.from_dict({"op_kind": ["conv"]})


def test_from_dict_of_empty_dict_is_default_config():
    assert QuantizerConfig.from_dict({}) == QuantizerConfig()


def test_to_dict_torch_dtype_spec_serialises_as_name():
    cfg = QuantizerConfig(weight=QuantizationSpec(dtype=torch.int8))
    assert cfg.to_dict()["weight"]["dtype"] == "int8"
