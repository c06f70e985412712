import numpy as np
import pytest
import torch

import coreai_opt as co
from coreai_opt.datasets import accuracy, load_digits_split, train_classifier
from coreai_opt.reference_models import DigitsCNN
from tests.api.auto_quantize.conftest import MEASURED, table


@pytest.fixture(scope="module")
def digits():
    split = load_digits_split(seed=0)
    torch.manual_seed(0)
    model = train_classifier(DigitsCNN(), split, epochs=3, lr=1e-2)
    return model, split


def test_auto_quantize_digits_cnn_keeps_every_conv_static_and_loses_no_accuracy(digits, tmp_path):
    model, split = digits
    batches = [split.x_train[i : i + 32] for i in range(0, 256, 32)]
    result = co.auto_quantize(model, batches, (batches[0],), cost_table=table(MEASURED), progress=False)
    convs = [u for u in result.report.units if u.kind == "conv"]
    assert [u.layers for u in convs] == [("features.0",), ("features.3",), ("features.7",)]
    assert all(u.choice == "static" for u in convs)
    # the 64 -> 10 classifier is float: at 640 MACs the Q/DQ overhead of every integer kernel costs more
    assert result.report.units[-1].choice == "float"
    assert result.report.notes == (
        "not measured: int16 (not allowed, or its cost-table line is nowhere below float's, so float, with zero "
        "error, is always at least as good)",
        "kept float because float is the fastest kernel at their size: classifier")
    assert all("int16" not in u.alternatives for u in result.report.units)
    assert result.capture == "export"  # the classifier's input was smoothed
    float_acc = accuracy(model, split.x_test, split.y_test)
    eager_acc = accuracy(result.converted, split.x_test, split.y_test)
    path = co.export_onnx(result.converted, (batches[0],), tmp_path / "digits.onnx")
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    ort_acc = accuracy(lambda x: sess.run(None, {name: x.numpy()})[0], split.x_test, split.y_test)
    assert float_acc > 0.95
    assert eager_acc >= float_acc - 0.0005 and ort_acc >= float_acc - 0.0005, (float_acc, eager_acc, ort_acc)
    assert np.isfinite(result.report.measured_error) and result.report.measured_error <= result.report.max_error
