import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

from coreai_opt import reference_models as rm
from coreai_opt.api import calibrate, convert, enable_fake_quant, enable_observers, prepare
from coreai_opt.config import QuantizerConfig
from coreai_opt.quantization.spec import PerChannel, QuantizationSpec


@pytest.fixture(scope="module")
def digits():
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y)
    return x[:1347], y[:1347], x[1347:], y[1347:]


def _accuracy(model, x, y) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def test_qat_fine_tuning_recovers_accuracy_lost_by_4bit_ptq(digits):
    xtr, ytr, xte, yte = digits
    torch.manual_seed(0)
    model = rm.DigitsCNN(width=8)
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    for _ in range(3):
        for idx in torch.randperm(len(xtr)).split(64):
            loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    cfg = QuantizerConfig(weight=QuantizationSpec(dtype="int4", granularity=PerChannel(0)),
                          activation=QuantizationSpec(dtype="uint4", qscheme="asymmetric",
                                                      qparams_calculator="global_minmax"))
    calibration = list(xtr[:512].split(128))
    ptq = prepare(model, cfg, (xtr[:2],))
    calibrate(ptq, calibration, progress=False)
    float_acc, ptq_acc = _accuracy(model, xte, yte), _accuracy(convert(ptq), xte, yte)

    qat = prepare(model, cfg, (xtr[:2],), qat=True)
    calibrate(qat, calibration, progress=False)
    opt = torch.optim.SGD(qat.parameters(), 1e-2, momentum=0.9)
    losses = []
    for _ in range(60):
        idx = torch.randint(0, len(xtr), (64,))
        loss = F.cross_entropy(qat(xtr[idx]), ytr[idx])
        opt.zero_grad()
        loss.backward()  # straight-through gradients through every quantizer
        opt.step()
        losses.append(loss.item())
    enable_observers(qat, False)
    qat_acc = _accuracy(convert(qat), xte, yte)
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    print(f"float {float_acc:.3f}, 4-bit PTQ {ptq_acc:.3f}, QAT {qat_acc:.3f}; QAT loss {first:.3f} -> {last:.3f}")
    assert last < first
    assert qat_acc > ptq_acc + 0.05 and qat_acc > float_acc - 0.03


def test_qat_weights_receive_gradients_and_fake_quant_can_be_disabled(digits):
    xtr, ytr, _, _ = digits
    model = rm.DigitsCNN(width=8).eval()
    qat = prepare(model, QuantizerConfig.presets.w8a8(), (xtr[:2],), qat=True)
    loss = F.cross_entropy(qat(xtr[:32]), ytr[:32])
    loss.backward()
    grads = [p.grad for name, p in qat.named_parameters() if name.endswith("weight")]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    enable_fake_quant(qat, False)
    qat.eval()
    with torch.no_grad():
        assert torch.allclose(qat(xtr[:8]), model(xtr[:8]), rtol=1e-4, atol=1e-5)
