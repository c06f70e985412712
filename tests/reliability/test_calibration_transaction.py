"""Calibration is a transaction: a calibrate that fails or is interrupted anywhere leaves the model exactly as before.

Each test calibrates the small CNN on good data, records every tensor of ``state_dict`` plus the state that is not
in it (training flags, pending commits, batch counters), then runs a second calibrate on other data that fails at
batch 3 (or in the commit phase, or in the distributed merge) and checks that everything is bit-identical to the
record and that ``convert`` gives the earlier scales.
"""

from __future__ import annotations

import copy
import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import fx

import coreai_opt as co
from coreai_opt.api.distributed import CalibrationSync, DistributedSyncError
from coreai_opt.api.internals.quantizer_snapshot import QuantizerSnapshot
from coreai_opt.api.internals.quantizer_state import fake_quantizers, stale_weight_quantizers
from coreai_opt.errors import CalibrationInProgressError, UnexpectedRuntimeError
from coreai_opt.quantization.spec import FakeQuantize
from tests.zoo import ZOO

from .conftest import Pipeline, cnn_batches

FAILING_BATCH = 3
#: The module (``coreai_opt.api.calibrate`` the attribute is the function).
calibrate_module = importlib.import_module("coreai_opt.api.calibrate")


def _other_data() -> list[torch.Tensor]:
    """Batches whose statistics differ from the first calibration's (10x the range)."""
    return [10.0 * b for b in cnn_batches(count=6, seed=7)]


def _full_state(model: fx.GraphModule) -> dict[str, Any]:
    """Every tensor of state_dict (cloned) and the quantizer state that is not in it."""
    state: dict[str, Any] = {f"tensor:{k}": v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    state |= {f"training:{name}": m.training for name, m in model.named_modules()}
    for name, fq in fake_quantizers(model):
        state[f"python:{name}"] = (fq._pending, fq.export_mode, fq.calculator.batches_since_sync,
                                   fq.calculator.range_calculator._warned_non_finite)
    state |= {f"bias:{name}": m.fake_quant_enabled for name, m in model.named_modules()
              if hasattr(m, "fake_quant_enabled") and not isinstance(m, FakeQuantize)}
    return state


def _assert_same_state(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before.keys() == after.keys()
    for key, value in before.items():
        if torch.is_tensor(value):
            assert torch.equal(value, after[key]), key
        else:
            assert value == after[key], key


def _scales(converted: fx.GraphModule) -> dict[str, torch.Tensor]:
    return {name: fq.calculator.scale.clone() for name, fq in fake_quantizers(converted)}


@pytest.fixture
def calibrated(cnn_pipeline: Pipeline) -> fx.GraphModule:
    """A private copy of the calibrated small-CNN prepared model."""
    return copy.deepcopy(cnn_pipeline.prepared)


def _failing_at(batches: list[torch.Tensor], error: BaseException) -> Iterator[torch.Tensor]:
    for index, batch in enumerate(batches):
        if index == FAILING_BATCH:
            raise error
        yield batch


class _InterruptingHook:
    """Forward pre-hook that raises KeyboardInterrupt on the FAILING_BATCH-th call (inside the model's forward)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        self.calls += 1
        if self.calls == FAILING_BATCH + 1:
            raise KeyboardInterrupt


FAILURES: dict[str, tuple[type[BaseException], Callable[[fx.GraphModule], Any]]] = {
    "data_iterator_raises": (RuntimeError, lambda m: _failing_at(_other_data(), RuntimeError("loader died"))),
    "keyboard_interrupt_in_data": (KeyboardInterrupt, lambda m: _failing_at(_other_data(), KeyboardInterrupt())),
    "bad_batch_dtype": (ValueError, lambda m: [*_other_data()[:FAILING_BATCH], torch.zeros(4, 3, 8, 8,
                                                                                            dtype=torch.float64)]),
    "zero_size_batch": (ValueError, lambda m: [*_other_data()[:FAILING_BATCH], torch.zeros(0, 3, 8, 8)]),
}


@pytest.mark.parametrize("failure", list(FAILURES))
def test_failed_calibrate_at_batch_3_leaves_every_tensor_and_flag_as_before(calibrated: fx.GraphModule,
                                                                            failure: str) -> None:
    expected_scales = _scales(co.convert(calibrated))
    before = _full_state(calibrated)
    error, make_data = FAILURES[failure]
    with pytest.raises(error):
        co.calibrate(calibrated, make_data(calibrated), progress=False)
    _assert_same_state(before, _full_state(calibrated))
    after_scales = _scales(co.convert(calibrated))
    assert all(torch.equal(expected_scales[k], after_scales[k]) for k in expected_scales)


def test_keyboard_interrupt_inside_the_forward_rolls_back(calibrated: fx.GraphModule) -> None:
    before = _full_state(calibrated)
    handle = calibrated.get_submodule("x_input_fq").register_forward_pre_hook(_InterruptingHook())
    try:
        with pytest.raises(KeyboardInterrupt):
            co.calibrate(calibrated, _other_data(), progress=False)
    finally:
        handle.remove()
    _assert_same_state(before, _full_state(calibrated))


def test_the_partial_run_really_changed_statistics_before_the_rollback(calibrated: fx.GraphModule,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Guard against a vacuous test: without the rollback the failed run leaves other scales behind."""
    before = _scales(co.convert(calibrated))
    monkeypatch.setattr(QuantizerSnapshot, "restore", lambda self: None)
    with pytest.raises(ValueError):
        co.calibrate(calibrated, [*_other_data()[:FAILING_BATCH], torch.zeros(0, 3, 8, 8)], progress=False)
    monkeypatch.undo()
    # convert commits the pending partial statistics: 10x data gives (much) larger activation scales
    after = _scales(co.convert(calibrated))
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) >= 3, changed


def test_failure_in_the_commit_phase_rolls_back_already_committed_quantizers(calibrated: fx.GraphModule,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    before = _full_state(calibrated)
    real_commit, calls = FakeQuantize.commit, []

    def commit_then_fail(self: FakeQuantize) -> None:
        calls.append(self.name)
        if len(calls) == 3:
            raise RuntimeError("disk full while committing")
        real_commit(self)
    monkeypatch.setattr(FakeQuantize, "commit", commit_then_fail)
    with pytest.raises(RuntimeError, match="disk full while committing"):
        co.calibrate(calibrated, _other_data(), progress=False)
    monkeypatch.undo()
    assert len(calls) == 3  # two quantizers were committed with the new statistics before the failure
    _assert_same_state(before, _full_state(calibrated))


def test_failure_after_the_weight_commit_restores_weight_qparams_and_their_commit_records(
        calibrated: fx.GraphModule, monkeypatch: pytest.MonkeyPatch) -> None:
    with torch.no_grad():
        calibrated.get_parameter("conv1.weight").mul_(3.0)  # e.g. a fine-tuning step between two calibrations
    stale_before = {fq.name for fq, _ in stale_weight_quantizers(calibrated)}
    assert stale_before, "the weight change must make a weight quantizer stale"
    before = _full_state(calibrated)
    real = calibrate_module.commit_weight_qparams

    def commit_then_fail(gm: fx.GraphModule) -> int:
        assert real(gm) == len(stale_before)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(calibrate_module, "commit_weight_qparams", commit_then_fail)
    with pytest.raises(OSError, match="No space left on device"):
        co.calibrate(calibrated, _other_data(), progress=False)
    monkeypatch.undo()
    _assert_same_state(before, _full_state(calibrated))
    assert {fq.name for fq, _ in stale_weight_quantizers(calibrated)} == stale_before  # recommitted next time


def test_failed_distributed_merge_rolls_back(calibrated: fx.GraphModule, monkeypatch: pytest.MonkeyPatch) -> None:
    """The merge fails after it changed statistics (as a rank failing mid-merge would): all rolled back."""
    before = _full_state(calibrated)

    def failing_finish(self: CalibrationSync) -> int:
        for _, fq in fake_quantizers(self.model):
            fq.calculator.range_calculator.reset()  # partially "merged" statistics
        raise DistributedSyncError("rank 1: calibration failed on rank(s) [1]")
    monkeypatch.setattr(CalibrationSync, "finish", failing_finish)
    with pytest.raises(DistributedSyncError, match="calibration failed on rank"):
        co.calibrate(calibrated, _other_data(), progress=False)
    _assert_same_state(before, _full_state(calibrated))


def test_calibrate_after_a_rolled_back_one_equals_calibrating_a_copy_once(calibrated: fx.GraphModule) -> None:
    reference = copy.deepcopy(calibrated)
    with pytest.raises(RuntimeError):
        co.calibrate(calibrated, _failing_at(_other_data(), RuntimeError("loader died")), progress=False)
    co.calibrate(calibrated, _other_data(), progress=False)
    co.calibrate(reference, _other_data(), progress=False)
    _assert_same_state(_full_state(reference), _full_state(calibrated))


def test_wrapped_user_error_keeps_the_original_and_names_the_stage(calibrated: fx.GraphModule) -> None:
    with pytest.raises(UnexpectedRuntimeError, match=r"coreai_opt calibrate failed while reading calibration "
                                                     r"batch 3 from data: RuntimeError: loader died") as info:
        co.calibrate(calibrated, _failing_at(_other_data(), RuntimeError("loader died")), progress=False)
    assert str(info.value.__cause__) == "loader died"


def test_snapshot_holds_only_quantizer_state_not_weights() -> None:
    """Measured on the zoo ResNet-18 (w8a8, minmax): the snapshot is the qparams, a few % of the model tensors."""
    entry = ZOO["resnet18"]
    model = entry.factory().eval()
    example = entry.make_input(2)
    prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), (example,))
    co.calibrate(prepared, [example], progress=False)
    model_bytes = sum(t.numel() * t.element_size() for t in prepared.parameters())
    quantizer_bytes = sum(t.numel() * t.element_size() for n, t in prepared.named_buffers() if "_fq." in n)
    snapshot = QuantizerSnapshot(prepared).nbytes
    assert snapshot <= quantizer_bytes
    assert snapshot < 0.03 * model_bytes, (snapshot, model_bytes)


# --------------------------------------------------------------------------------------------- one call at a time
class _BlockingData:
    """Yields batches; before the second one it signals ``started`` and waits for ``release``."""

    def __init__(self, batches: list[torch.Tensor]) -> None:
        self.batches = batches
        self.started, self.release = threading.Event(), threading.Event()

    def __iter__(self) -> Iterator[torch.Tensor]:
        for index, batch in enumerate(self.batches):
            if index == 1:
                self.started.set()
                assert self.release.wait(timeout=60)
            yield batch


def test_second_thread_calibrating_the_same_model_gets_a_clear_error_at_once(calibrated: fx.GraphModule) -> None:
    reference = copy.deepcopy(calibrated)
    data = _BlockingData(_other_data())
    errors: list[BaseException] = []

    def first() -> None:
        try:
            co.calibrate(calibrated, data, progress=False)
        except BaseException as exc:  # noqa: BLE001 - reported through the list
            errors.append(exc)
    thread = threading.Thread(target=first, name="calibrator-1")
    thread.start()
    try:
        assert data.started.wait(timeout=60)
        with pytest.raises(CalibrationInProgressError, match=r"calibrate: calibrate in thread 'calibrator-1' is "
                                                             r"already changing the quantizers"):
            co.calibrate(calibrated, cnn_batches(), progress=False)
        with pytest.raises(CalibrationInProgressError, match=r"^convert: "):
            co.convert(calibrated)
        with pytest.raises(CalibrationInProgressError, match=r"^sensitivity: "):
            co.sensitivity(calibrated, cnn_batches(count=1))
    finally:
        data.release.set()
        thread.join(timeout=120)
    assert not errors
    co.calibrate(reference, _other_data(), progress=False)  # the first call alone decided the statistics
    _assert_same_state(_full_state(reference), _full_state(calibrated))


def test_calibrate_re_entered_from_its_data_iterator_raises_and_rolls_back(calibrated: fx.GraphModule) -> None:
    before = _full_state(calibrated)

    def reentrant() -> Iterator[torch.Tensor]:
        yield _other_data()[0]
        co.calibrate(calibrated, cnn_batches(), progress=False)
        yield _other_data()[1]
    with pytest.raises(CalibrationInProgressError, match="cannot run concurrently on one model"):
        co.calibrate(calibrated, reentrant(), progress=False)
    _assert_same_state(before, _full_state(calibrated))
    co.calibrate(calibrated, cnn_batches(), progress=False)  # the guard was released


def test_failed_calibrate_of_a_gptq_weight_model_restores_the_rounded_weights_and_hessians(monkeypatch):
    """GPTQ re-rounds its weights from new Hessians inside calibrate: a failure after that restores both exactly."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    config = co.QuantizerConfig.presets.w4(block_size=32, algorithm="gptq")
    first = [torch.randn(16, 64) for _ in range(4)]
    prepared = co.prepare(model, config, (first[0],))
    co.calibrate(prepared, first, progress=False)
    before = _full_state(prepared)
    expected = co.convert(prepared)(first[0])
    real_commit = calibrate_module.commit_weight_qparams

    def commit_then_fail(gm: fx.GraphModule, **kwargs: Any) -> int:
        assert real_commit(gm, **kwargs) == 2  # both linears re-rounded from the new statistics
        raise RuntimeError("disk full")

    monkeypatch.setattr(calibrate_module, "commit_weight_qparams", commit_then_fail)
    with pytest.raises(RuntimeError, match="disk full"):
        co.calibrate(prepared, [3.0 * torch.randn(16, 64) + 1.0 for _ in range(4)], progress=False)
    _assert_same_state(before, _full_state(prepared))
    assert torch.equal(co.convert(prepared)(first[0]), expected)


def test_failed_first_gptq_calibrate_recommits_the_provisional_results_bit_for_bit_and_never_holds_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A freshly prepared GPTQ model holds data-free provisional results; the rollback snapshot saves none of them
    (restore recommits them from the weights), so they are freed as soon as GPTQ replaces them."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    data = [torch.randn(16, 64) for _ in range(4)]
    prepared = co.prepare(model, co.QuantizerConfig.presets.w4(block_size=32, algorithm="gptq"), (data[0],))
    roundings = [fq.rounding for _, fq in fake_quantizers(prepared) if fq.rounding is not None]
    assert len(roundings) == 2 and all(bool(r.awaiting_data) for r in roundings)
    integers = {id(r.qweight) for r in roundings}
    saved = [b for m in QuantizerSnapshot(prepared)._modules for b in m.buffers.values()]
    assert not any(id(b.tensor) in integers or b.copy is not None and b.copy.numel() > 64 for b in saved)
    before = _full_state(prepared)
    provisional = [weakref.ref(r.qweight) for r in roundings]
    real_commit = calibrate_module.commit_weight_qparams
    alive_after_commit: list[bool] = []

    def commit_then_fail(gm: fx.GraphModule, **kwargs: Any) -> int:
        assert real_commit(gm, **kwargs) == 2  # both linears rounded by GPTQ from the new Hessians
        gc.collect()
        alive_after_commit.extend(ref() is not None for ref in provisional)
        raise RuntimeError("disk full")

    monkeypatch.setattr(calibrate_module, "commit_weight_qparams", commit_then_fail)
    with pytest.raises(RuntimeError, match="disk full"):
        co.calibrate(prepared, data, progress=False)
    assert alive_after_commit == [False, False]  # nothing kept the provisional integers during calibrate
    _assert_same_state(before, _full_state(prepared))
    assert all(bool(r.awaiting_data) for r in roundings)


def test_convert_shares_the_rounded_integers_and_loading_a_state_never_writes_through_them() -> None:
    """convert holds a GPTQ model's integers and qparams once (the prepared model's tensors); loading a state into
    either model gives it its own copy first, so the other one keeps its values."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    data = [torch.randn(16, 64) for _ in range(4)]
    prepared = co.prepare(model, co.QuantizerConfig.presets.w4(block_size=32, algorithm="gptq"), (data[0],))
    co.calibrate(prepared, data, progress=False)
    converted = co.convert(prepared)
    ours = [fq.rounding for _, fq in fake_quantizers(prepared) if fq.rounding is not None]
    theirs = [fq.rounding for _, fq in fake_quantizers(converted) if fq.rounding is not None]
    assert all(a.qweight is b.qweight and a.scale is b.scale for a, b in zip(ours, theirs, strict=True))
    expected = converted(data[0])
    kept = [r.qweight.clone() for r in ours]
    other = {k: (torch.zeros_like(v) if k.endswith("qweight") else v) for k, v in converted.state_dict().items()}
    co.load_state_dict(converted, other)
    theirs = [fq.rounding for _, fq in fake_quantizers(converted) if fq.rounding is not None]
    assert all(int(r.qweight.abs().sum()) == 0 for r in theirs)  # loaded into the converted model ...
    assert all(torch.equal(r.qweight, k) for r, k in zip(ours, kept, strict=True))  # ... not through to prepared
    co.load_state_dict(prepared, prepared.state_dict())
    assert torch.equal(co.convert(prepared)(data[0]), expected)
