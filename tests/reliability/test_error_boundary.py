"""No public function lets a torch / onnx / Python exception escape without a coreai_opt message in front of it.

The public functions are enumerated from the ``__all__`` of ``coreai_opt``, ``coreai_opt.api``, ``coreai_opt.onnx``,
``coreai_opt.config`` (and its ``presets``) and ``coreai_opt.onnx.export.save``'s writers: every function, and every
public method of every exported class, must carry the ``public_api`` marker. Behaviour tests then force foreign
exceptions out of several of them.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
from torch import fx, nn

import coreai_opt as co
import coreai_opt.onnx.export.export_onnx as onnx_export
from coreai_opt.error_boundary import PUBLIC_API_ATTRIBUTE, error_stage, is_own_error, public_api
from coreai_opt.errors import CoreaiOptError, UnexpectedError, UnexpectedIndexError, UnexpectedKeyError

from .conftest import Pipeline, cnn_batches

PUBLIC_MODULES = ("coreai_opt", "coreai_opt.api", "coreai_opt.onnx", "coreai_opt.config", "coreai_opt.config.presets",
                  # the modules coreai_opt re-exports functions from: their results' classes are public too
                  "coreai_opt.api.algorithms.smooth_quant", "coreai_opt.api.algorithms.sensitivity",
                  "coreai_opt.api.algorithms.calibration_search",
                  "coreai_opt.api.algorithms.auto_quantize")
#: Value types of the override vocabulary (``co.PerTensor`` / ``co.PerChannel`` / ``co.PerBlock``): users construct
#: them (their validation is behind ``QuantizationSpec``'s boundary); their methods are the tensor mechanics the
#: library calls on every fake-quantize forward, not entry points.
VALUE_TYPES = ("PerTensor", "PerChannel", "PerBlock")
EXTRA_PUBLIC = ("coreai_opt.onnx.export.save.write_bytes_atomically",
                "coreai_opt.onnx.export.save.write_text_atomically")


def _own_attributes(cls: type) -> dict[str, Any]:
    """``vars`` of the class and of its coreai_opt bases (inherited public methods are public API too)."""
    attributes: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.startswith("coreai_opt"):
            attributes.update(vars(klass))
    return attributes


def _class_methods(cls: type, seen: set[int]) -> Iterator[tuple[str, Any]]:
    for name, value in _own_attributes(cls).items():
        if name.startswith("_"):
            continue
        raw = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
        if inspect.isclass(raw):
            if id(raw) not in seen:
                seen.add(id(raw))
                yield from ((f"{cls.__name__}.{n}", f) for n, f in _class_methods(raw, seen))
        elif inspect.isfunction(raw):
            yield f"{cls.__qualname__}.{name}", raw


def public_callables() -> list[tuple[str, Any]]:
    """Every public function and public method reachable from the public ``__all__`` lists."""
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if inspect.isclass(obj) and name not in VALUE_TYPES:
                found += list(_class_methods(obj, seen))
            elif inspect.isfunction(obj):
                found.append((f"{module_name}.{name}", obj))
    for dotted in EXTRA_PUBLIC:
        module_name, _, name = dotted.rpartition(".")
        found.append((dotted, getattr(importlib.import_module(module_name), name)))
    return found


def test_the_enumeration_finds_the_public_api() -> None:
    names = {name for name, _ in public_callables()}
    for expected in ("coreai_opt.calibrate", "coreai_opt.export_onnx", "coreai_opt.verify_onnx", "coreai_opt.prepare",
                     "coreai_opt.search_calibration", "QuantizerConfig.from_yaml", "QuantizerConfig.set_module_type",
                     "QuantizerConfig.Presets.w8a8", "coreai_opt.config.normalize_module_type",
                     "QuantizationSummary.counts", "SensitivityReport.most_sensitive", "SmoothQuantResult.table",
                     "coreai_opt.auto_quantize", "AutoQuantizeReport.table", "CostTable.from_dict"):
        assert expected in names, expected
    assert len(names) >= 60


@pytest.mark.parametrize(("name", "function"), public_callables(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_public_function_is_behind_the_error_boundary(name: str, function: Any) -> None:
    assert getattr(function, PUBLIC_API_ATTRIBUTE, None), f"{name} is not decorated with @public_api"


# ----------------------------------------------------------------------------------------------- classification
def _run_as_coreai_opt_code(source: str) -> BaseException:
    """Execute ``source`` as if it were a coreai_opt module; return what it raised."""
    namespace = {"__name__": "coreai_opt._probe"}
    exec(compile(f"def probe():\n    {source}\n", "coreai_opt/_probe.py", "exec"), namespace)  # noqa: S102
    try:
        namespace["probe"]()
    except BaseException as exc:  # noqa: BLE001 - returned for inspection
        return exc
    raise AssertionError("probe did not raise")


@pytest.mark.parametrize(("source", "own"), [
    ("raise ValueError('calibration data is empty: pass an iterable')", True),
    ("raise TypeError('path must be a str')", True),
    ("raise FileNotFoundError('directory x does not exist; create it first')", True),
    ("int('x')", False),  # a ValueError a builtin raised while our code called it
    ("{}['missing']", False),  # a slip in our own code
    ("raise AssertionError('internal')", False),
])
def test_errors_are_ours_only_when_our_code_raised_them_with_a_message(source: str, own: bool) -> None:
    assert is_own_error(_run_as_coreai_opt_code(source)) is own


def test_foreign_errors_are_wrapped_in_their_builtin_family_with_the_original_as_cause() -> None:
    @public_api
    def lookup() -> None:
        with error_stage("looking up a key"):
            {}["missing"]  # noqa: B018
    with pytest.raises(UnexpectedKeyError, match=r"^coreai_opt test_foreign_errors.*lookup failed while looking up "
                                                 r"a key: KeyError: 'missing' \(raised in tests\.") as info:
        lookup()
    assert isinstance(info.value, KeyError) and isinstance(info.value.__cause__, KeyError)
    assert info.value.stage == "looking up a key"


def test_a_warning_turned_into_an_error_by_a_filter_is_not_wrapped() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="quantizes nothing") as info:
            co.prepare(nn.Sequential(nn.Linear(2, 2)).eval(), co.QuantizerConfig(), (torch.randn(1, 2),))
    assert type(info.value) is UserWarning


def test_a_call_with_wrong_arguments_is_the_callers_type_error_unchanged() -> None:
    with pytest.raises(TypeError, match=r"^prepare\(\) missing 1 required positional argument: 'example_inputs'$") \
            as info:
        co.prepare(nn.Linear(2, 2).eval(), (torch.randn(1, 2),))  # the config forgotten
    assert type(info.value) is TypeError

    @public_api
    def typed() -> None:
        len(3)  # a TypeError inside the body is foreign: wrapped
    with pytest.raises(UnexpectedError, match="object of type 'int' has no len"):
        typed()


def test_keyboard_interrupt_is_never_wrapped() -> None:
    @public_api
    def interrupted() -> None:
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt) as info:
        interrupted()
    assert type(info.value) is KeyboardInterrupt


# ------------------------------------------------------------------------------------------ forced foreign errors
class _ComputedIds(nn.Module):
    """Token ids computed inside the model (not a model input), so only torch sees an out-of-range id."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(x + 5).mean(dim=1)


def test_calibrate_wraps_a_torch_index_error_naming_the_batch() -> None:
    prepared = co.prepare(_ComputedIds().eval(), co.QuantizerConfig.presets.w8a8(),
                          (torch.zeros(2, 3, dtype=torch.long),))
    bad = torch.full((2, 3), 7, dtype=torch.long)  # 7 + 5 = 12 >= 10 rows
    with pytest.raises(UnexpectedIndexError, match=r"^coreai_opt calibrate failed while running calibration batch 1 "
                                                   r"through the model: IndexError: index out of range in self "
                                                   r"\(raised in torch\.") as info:
        co.calibrate(prepared, [torch.zeros(2, 3, dtype=torch.long), bad], progress=False)
    assert isinstance(info.value, IndexError) and isinstance(info.value.__cause__, IndexError)


def test_export_onnx_wraps_an_exporter_crash(cnn_pipeline: Pipeline, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(*args: object) -> onnx.ModelProto:
        raise onnx.checker.ValidationError("Field 'type' of 'value_info' is required but missing.")
    monkeypatch.setattr(onnx_export, "_export_proto", crash)
    with pytest.raises(UnexpectedError, match=r"^coreai_opt export_onnx failed: .*ValidationError: Field 'type'"):
        co.export_onnx(cnn_pipeline.converted, (cnn_pipeline.example,), tmp_path / "m.onnx")


def test_from_yaml_wraps_a_yaml_syntax_error() -> None:
    with pytest.raises(UnexpectedError, match=r"^coreai_opt QuantizerConfig\.from_yaml failed: yaml\.\w+\.\w+Error"):
        co.QuantizerConfig.from_yaml("weight: [unclosed\n")


def test_fusion_report_and_verify_wrap_onnx_and_onnxruntime_errors_on_a_corrupt_file(cnn_pipeline: Pipeline,
                                                                                    tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"this is not a protobuf")
    with pytest.raises(UnexpectedError, match=r"^coreai_opt fusion_report failed"):
        co.fusion_report(corrupt)
    with pytest.raises(UnexpectedError, match=r"^coreai_opt verify_onnx failed"):
        co.verify_onnx(cnn_pipeline.converted, corrupt, cnn_pipeline.example)


def test_search_calibration_wraps_a_user_data_error() -> None:
    class LoaderError(Exception):
        pass

    def data() -> Iterator[torch.Tensor]:
        yield cnn_batches(1)[0]
        raise LoaderError("shard 3 missing")
    from .conftest import make_small_cnn
    prepared = co.prepare(make_small_cnn(), co.QuantizerConfig.presets.w8a8(), (cnn_batches(1)[0],))
    with pytest.raises(UnexpectedError, match=r"search_calibration failed: .*LoaderError: shard 3 missing"):
        co.search_calibration(prepared, data())


def test_our_own_errors_pass_unchanged(cnn_pipeline: Pipeline) -> None:
    prepared: fx.GraphModule = copy.deepcopy(cnn_pipeline.prepared)
    with pytest.raises(ValueError) as info:
        co.calibrate(prepared, [], progress=False)
    assert type(info.value) is ValueError and str(info.value).startswith("calibration data is empty")
    with pytest.raises(TypeError) as info:
        co.calibrate(nn.Linear(2, 2), [], progress=False)  # type: ignore[arg-type]
    assert type(info.value) is TypeError and not isinstance(info.value, CoreaiOptError)
