"""The top-level API: every public name resolves, type checkers see each one, overrides need no deep import."""

from __future__ import annotations

import ast
from pathlib import Path

import coreai_opt as co
from coreai_opt.config.op_config import OpConfig
from coreai_opt.onnx.verify.localize import localize_divergence
from coreai_opt.quantization.spec.granularity import PerBlock, PerChannel, PerTensor

INIT = Path(co.__file__)


def test_every_public_name_resolves_lazily_to_its_defining_object():
    assert len(co.__all__) == 25 and sorted(co.__all__) == co.__all__
    assert all(getattr(co, name) is not None for name in co.__all__)
    assert (co.OpConfig, co.PerTensor, co.PerChannel, co.PerBlock, co.localize_divergence) == (
        OpConfig, PerTensor, PerChannel, PerBlock, localize_divergence)


def test_type_checkers_see_every_public_name_in_the_type_checking_block():
    tree = ast.parse(INIT.read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    seen = {alias.name for node in ast.walk(block) if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert seen == set(co.__all__)


def test_an_override_is_written_with_top_level_names_only():
    config = co.QuantizerConfig.presets.w8a8().set_module_name(
        "fc", co.OpConfig(weight=co.QuantizationSpec(dtype="int4", granularity=co.PerBlock(axis=1, block_size=32))))
    resolved = config.resolve("linear", "fc", None)
    assert resolved.weight.granularity == PerBlock(axis=1, block_size=32) and resolved.weight.dtype == "int4"


def test_an_unknown_name_is_an_attribute_error_naming_it():
    try:
        co.not_a_name  # noqa: B018
    except AttributeError as error:
        assert "not_a_name" in str(error)
    else:
        raise AssertionError("no error")
