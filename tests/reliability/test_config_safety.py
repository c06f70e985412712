"""Config safety: a config never imports (runs) a module it names, and entries that match nothing are reported."""

from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.config import OpConfig, QuantizerConfig
from coreai_opt.errors import ConfigImportError

from .conftest import cnn_batches, make_small_cnn

_MODULE_SOURCE = """
import pathlib
pathlib.Path({marker!r}).write_text("top-level code ran")
import torch
class PlantedConv(torch.nn.Conv2d):
    pass
"""


@pytest.fixture
def planted_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """An importable module ``planted_pkg.layers`` whose top-level code writes a marker file."""
    name = f"planted_pkg_{tmp_path.name.replace('-', '_')}"
    package = tmp_path / name
    package.mkdir()
    (package / "__init__.py").write_text("")
    marker = tmp_path / "marker.txt"
    (package / "layers.py").write_text(_MODULE_SOURCE.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name, marker
    for key in [k for k in sys.modules if k.startswith(name)]:
        del sys.modules[key]


@pytest.mark.parametrize("how", ["yaml", "dict", "setter"])
def test_a_module_type_naming_a_module_that_is_not_imported_is_refused_without_running_it(
        planted_module: tuple[str, Path], how: str) -> None:
    package, marker = planted_module
    key = f"{package}.layers.PlantedConv"
    build = {
        "yaml": lambda: QuantizerConfig.from_yaml(f"module_type:\n  {key}: null\n"),
        "dict": lambda: QuantizerConfig.from_dict({"module_type": {key: None}}),
        "setter": lambda: QuantizerConfig().set_module_type(key, None),
    }[how]
    with pytest.raises(ValueError, match=rf"module_type key '{key}': the module defining it .*is not imported.*"
                                         rf"Import your module before building the config.*set_module_type") as info:
        build()
    assert not marker.exists(), "the module's top-level code must not run"
    assert f"{package}.layers" not in sys.modules and package not in sys.modules
    if how == "setter":
        assert isinstance(info.value, ConfigImportError)


def test_the_same_key_works_once_the_user_imported_the_module(planted_module: tuple[str, Path]) -> None:
    package, marker = planted_module
    module = importlib.import_module(f"{package}.layers")  # the user's own import runs it, as they intend
    assert marker.exists()
    config = QuantizerConfig.from_yaml(f"module_type:\n  {package}.layers.PlantedConv: null\n")
    assert list(config.module_type) == [f"{package}.layers.PlantedConv"]
    assert config.resolve("conv", "c", module.PlantedConv).source == f"module_type:{package}.layers.PlantedConv"


def test_a_package_imported_without_its_submodule_names_the_submodule(planted_module: tuple[str, Path]) -> None:
    package, marker = planted_module
    importlib.import_module(package)  # the package, not .layers
    with pytest.raises(ConfigImportError, match=rf"'{package}\.layers'"):
        QuantizerConfig().set_module_type(f"{package}.layers.PlantedConv", None)
    assert not marker.exists()


def test_torch_nn_names_resolve_as_before() -> None:
    config = QuantizerConfig.from_yaml("module_type:\n  torch.nn.Conv2d: null\n  torch.nn.modules.linear.Linear: {}\n")
    assert list(config.module_type) == ["torch.nn.modules.conv.Conv2d", "torch.nn.modules.linear.Linear"]


def _prepare_quietly(config: QuantizerConfig) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        co.prepare(make_small_cnn(), config, (cnn_batches(1)[0],))


def test_module_type_entry_matching_no_module_warns_at_prepare() -> None:
    config = co.QuantizerConfig.presets.w8a8().set_module_type(nn.LSTM, None)
    with pytest.warns(UserWarning, match=r"module_type key\(s\) \['torch\.nn\.modules\.rnn\.LSTM'\] match no module "
                                         r"of SmallCNN"):
        co.prepare(make_small_cnn(), config, (cnn_batches(1)[0],))
    _prepare_quietly(co.QuantizerConfig.presets.w8a8().set_module_type(nn.Conv2d, OpConfig(activation=None)))
    _prepare_quietly(co.QuantizerConfig.presets.w8a8().set_module_type(nn.Module, OpConfig()))  # a base class


def test_op_kind_entry_matching_no_op_warns_at_prepare_listing_the_models_kinds() -> None:
    config = co.QuantizerConfig.presets.w8a8().set_op_kind("softmax", None)
    with pytest.warns(UserWarning, match=r"op_kind key\(s\) \['softmax'\] match no op of SmallCNN \(its op kinds: "
                                         r".*conv.*linear.*relu.*\)"):
        co.prepare(make_small_cnn(), config, (cnn_batches(1)[0],))
    _prepare_quietly(co.QuantizerConfig.presets.w8a8().set_op_kind("relu", None))


def test_the_warning_points_at_the_users_prepare_line() -> None:
    config = co.QuantizerConfig.presets.w8a8().set_op_kind("softmax", None)
    with pytest.warns(UserWarning, match="op_kind") as record:
        co.prepare(make_small_cnn(), config, (torch.randn(2, 3, 8, 8),))
    assert Path(record[0].filename).name == Path(__file__).name


def test_a_config_that_quantizes_nothing_warns() -> None:
    with pytest.warns(UserWarning, match=r"the config quantizes nothing in SmallCNN: no weight or activation got a "
                                         r"quantizer.*presets\.w8a8"):
        co.prepare(make_small_cnn(), QuantizerConfig(), (cnn_batches(1)[0],))
    with pytest.warns(UserWarning, match=r"op_kind key\(s\) \['linear'\] match no op of Sequential"):
        co.prepare(nn.Sequential(nn.Conv2d(3, 4, 3)).eval(), co.QuantizerConfig.presets.w8a8_dynamic(),
                   (cnn_batches(1)[0],))
