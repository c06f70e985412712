"""coreai-opt quantize on save_pretrained directories: a tiny BERT with its tokenizer, a tiny ViT with its processor."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from coreai_opt import huggingface
from coreai_opt.cli.main import main
from tests.cli.conftest import SEQ_LEN, WORDS, save_images, save_tiny_bert, save_tiny_vit


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_from_pretrained_builds_the_task_head_and_tokenizer_inputs_in_forward_order(tiny_bert_dir):
    import coreai_opt as co

    assert co.from_pretrained is huggingface.from_pretrained  # the public name
    hf = co.from_pretrained(tiny_bert_dir, seq_len=SEQ_LEN)
    assert hf.architecture == "BertForSequenceClassification"
    # the tokenizer yields input_ids, token_type_ids, attention_mask; forward() takes attention_mask second
    assert hf.input_names == ("input_ids", "attention_mask", "token_type_ids")
    ids, mask, types = hf.text_inputs(["the cat sat", "dog"])
    vocab = {w: i for i, w in enumerate(WORDS)}
    assert ids.dtype == torch.int64 and ids.shape == (2, SEQ_LEN)
    assert ids[0, :5].tolist() == [vocab["[CLS]"], vocab["the"], vocab["cat"], vocab["sat"], vocab["[SEP]"]]
    assert ids[0, 5:].tolist() == [vocab["[PAD]"]] * (SEQ_LEN - 5)
    assert mask[0].tolist() == [1] * 5 + [0] * (SEQ_LEN - 5) and mask[1].sum() == 3
    assert types.abs().sum() == 0
    # the inputs reach the model by position, so the logits equal a keyword call
    with torch.no_grad():
        by_position = hf.model(ids, mask, types).logits
        by_name = hf.model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
    torch.testing.assert_close(by_position, by_name, rtol=0, atol=0)


def test_random_text_inputs_stay_in_the_vocabulary(tiny_bert_dir):
    hf = huggingface.from_pretrained(tiny_bert_dir, seq_len=SEQ_LEN)
    ids, mask, types = hf.random_inputs(64, seed=3)
    assert ids.shape == (64, SEQ_LEN) and int(ids.min()) >= 0 and int(ids.max()) == len(WORDS) - 1
    assert mask.min() == mask.max() == 1 and types.abs().sum() == 0


@pytest.fixture(scope="module")
def quantized_bert(tiny_bert_dir, calib_text, tmp_path_factory) -> tuple[Path, str]:
    output = tmp_path_factory.mktemp("bert_out") / "bert.onnx"
    code = main(["quantize", str(tiny_bert_dir), "--calib-text", str(calib_text), "--seq-len", str(SEQ_LEN),
                 "-o", str(output), "--latency-runs", "3"])
    assert code == 0
    return output, str(tiny_bert_dir)


def test_quantize_bert_directory_with_calibration_text_verifies(quantized_bert, calib_text):
    output, _ = quantized_bert
    report = json.loads(output.with_name("bert.report.json").read_text())
    assert report["ok"] is True and report["argmax_agreement"] == 1.0
    assert [(i["name"], i["dtype"], i["samples_shape"]) for i in report["inputs"]] == [
        ("input_ids", "int64", [8, SEQ_LEN]), ("attention_mask", "int64", [8, SEQ_LEN]),
        ("token_type_ids", "int64", [8, SEQ_LEN])]
    assert report["calibration"] == f"{calib_text} (8 lines, {SEQ_LEN} tokens)"
    # every linear of the 2-layer BERT plus the pooler, and both attention matmuls of each layer (SDPA decomposed)
    assert report["integer_compute"] == {"QGemm": 14, "QLinearMatMul": 4}
    import onnxruntime as ort

    session = ort.InferenceSession(str(output), providers=["CPUExecutionProvider"])
    # the sequence axis the capture kept symbolic stays dynamic in the file (issue 13, cause 6)
    axes = ["batch", "sequence"]
    assert [(i.name, i.type, i.shape) for i in session.get_inputs()] == [
        ("input_ids", "tensor(int64)", axes), ("attention_mask", "tensor(int64)", axes),
        ("token_type_ids", "tensor(int64)", axes)]
    longer = {i.name: np.ones((3, 2 * SEQ_LEN), np.int64) for i in session.get_inputs()}
    assert session.run(None, longer)[0].shape[0] == 3  # another batch and twice the calibration length run


def test_quantize_vit_directory_with_an_image_folder_verifies(capsys, tmp_path):
    vit = save_tiny_vit(tmp_path / "tiny-vit")
    images = save_images(tmp_path / "images", count=6)
    output = tmp_path / "vit.onnx"
    code, out, err = _run(capsys, "quantize", str(vit), "--calib-images", str(images), "-o", str(output),
                          "--latency-runs", "0")
    assert code == 0, err
    assert err == ""
    report = json.loads(output.with_name("vit.report.json").read_text())
    assert report["ok"] is True
    assert report["inputs"] == [{"name": "pixel_values", "dtype": "float32", "batch_shape": [6, 3, 32, 32],
                                 "samples_shape": [6, 3, 32, 32]}]
    assert report["calibration"] == f"{images} (6 images)"
    # the processor rescales to [0, 1] and normalizes with mean 0.5, std 0.5: pixel values lie in [-1, 1]
    hf = huggingface.from_pretrained(vit)
    (pixels,) = hf.image_inputs(sorted(images.iterdir()))
    assert pixels.shape == (6, 3, 32, 32) and float(pixels.min()) >= -1.0 and float(pixels.max()) <= 1.0


def test_hf_directory_without_transformers_names_the_extra(capsys, tiny_bert_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    code, _, err = _run(capsys, "quantize", str(tiny_bert_dir), "--seq-len", "8")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "needs the 'transformers' package; install the hf extra: pip install \"coreai-opt-qdq[hf]\"" in err


def test_hf_directory_with_custom_architecture_is_refused(capsys, tmp_path):
    directory = save_tiny_bert(tmp_path / "custom")
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["MyOwnBertForEverything"]
    (directory / "config.json").write_text(json.dumps(config))
    code, _, err = _run(capsys, "quantize", str(directory), "--seq-len", "8")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "names the architecture 'MyOwnBertForEverything', which is not built into transformers" in err
    assert "trust_remote_code stays off" in err


def test_hf_seq_len_longer_than_the_position_table_is_refused(capsys, tiny_bert_dir):
    code, _, err = _run(capsys, "quantize", str(tiny_bert_dir), "--seq-len", "65")
    assert code == 2
    assert "seq_len 65 is longer than the model's 64 positions; pass at most 64" in err


def test_hf_only_options_on_a_factory_model_are_refused(capsys, tmp_path, calib_text):
    (tmp_path / "m.py").write_text("import torch\ndef make():\n    return torch.nn.Linear(4, 2)\n")
    code, _, err = _run(capsys, "quantize", f"{tmp_path / 'm.py'}:make", "--calib-text", str(calib_text))
    assert code == 2
    assert "--calib-text works with a Hugging Face save_pretrained directory" in err


def test_broken_torchvision_under_transformers_names_the_real_cause_and_the_fix(tmp_path):
    """transformers hides a failed lazy import behind 'Could not import module X'; we name torchvision."""
    import types

    from coreai_opt.huggingface import MissingExtraError, _model_class

    class LazyTransformers(types.ModuleType):
        PreTrainedModel = type("PreTrainedModel", (), {})

        def __getattr__(self, name):
            try:
                raise RuntimeError("operator torchvision::nms does not exist")
            except RuntimeError as inner:
                raise ModuleNotFoundError(f"Could not import module '{name}'") from inner

    config = types.SimpleNamespace(architectures=["BertForSequenceClassification"])
    with pytest.raises(MissingExtraError) as info:
        _model_class(LazyTransformers("transformers"), config, tmp_path)
    message = str(info.value)
    assert "BertForSequenceClassification" in message
    assert "torchvision does not match torch" in message and "operator torchvision::nms" in message
    assert "uninstall torchvision" in message


def _file_bytes(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_llama_directory_saved_with_use_cache_quantizes_and_its_files_stay_untouched(capsys, tiny_llama_dir,
                                                                                    calib_text, tmp_path):
    """config.json says use_cache=true (a forward returns a DynamicCache); the loader turns it off in memory only."""
    assert json.loads((tiny_llama_dir / "config.json").read_text())["use_cache"] is True
    before = _file_bytes(tiny_llama_dir)
    output = tmp_path / "llama.onnx"
    code, _, err = _run(capsys, "quantize", str(tiny_llama_dir), "--calib-text", str(calib_text), "--seq-len",
                        str(SEQ_LEN), "-o", str(output), "--latency-runs", "0")
    assert code == 0, err
    report = json.loads(output.with_name("llama.report.json").read_text())
    assert report["ok"] is True
    assert report["calibration"] == f"{calib_text} (8 lines, {SEQ_LEN} tokens)"
    assert _file_bytes(tiny_llama_dir) == before
    hf = huggingface.from_pretrained(tiny_llama_dir, seq_len=SEQ_LEN)
    assert hf.model.config.use_cache is False and hf.architecture == "LlamaForCausalLM"


def test_decoder_tokenizer_without_pad_token_pads_with_eos_under_a_zero_mask(tiny_llama_dir):
    from transformers import AutoTokenizer

    from tests.cli.conftest import DECODER_WORDS

    assert AutoTokenizer.from_pretrained(tiny_llama_dir, local_files_only=True).pad_token is None  # as saved
    hf = huggingface.from_pretrained(tiny_llama_dir, seq_len=SEQ_LEN)
    assert hf.input_names == ("input_ids", "attention_mask")
    ids, mask = hf.text_inputs(["the cat sat", "dog"])
    vocab = {w: i for i, w in enumerate(DECODER_WORDS)}
    assert ids.shape == mask.shape == (2, SEQ_LEN)
    assert ids[0].tolist() == [vocab["the"], vocab["cat"], vocab["sat"]] + [vocab["</s>"]] * (SEQ_LEN - 3)
    assert mask[0].tolist() == [1] * 3 + [0] * (SEQ_LEN - 3) and mask[1].tolist() == [1] + [0] * (SEQ_LEN - 1)
    # the padded positions do not reach the real tokens: their logits equal an unpadded forward
    with torch.no_grad():
        padded = hf.model(ids[:1], mask[:1]).logits[0, :3]
        alone = hf.model(ids[:1, :3], mask[:1, :3]).logits[0]
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-5)


def test_tokenizer_without_any_special_token_to_pad_with_is_refused_with_the_fix():
    class Bare:
        pad_token = eos_token = unk_token = bos_token = None

    with pytest.raises(ValueError, match=r"has no pad, EOS, UNK or BOS token, .*add_special_tokens"):
        huggingface._with_pad_token(Bare())


def test_quantize_llama_directory_for_text_generation_writes_a_kv_cache_decoder_that_generates_like_eager(
        capsys, tiny_llama_dir, calib_text, tmp_path):
    import onnxruntime as ort

    output = tmp_path / "llama.onnx"
    # w4 (weight-only): w8a8 on these 8 lines gives 127/128 here, its one flip a near-tie at the last step (eager
    # top-2 margin 0.0043), reported and failed by the strict check (tests/onnx/test_kv_cache_export.py runs w8a8)
    code, out, err = _run(capsys, "quantize", str(tiny_llama_dir), "--task", "text-generation", "--preset", "w4",
                          "--calib-text", str(calib_text), "-o", str(output))
    assert code == 0, err
    record = json.loads(output.with_name("llama.generation.json").read_text())
    assert record["ok"] is True and record["tokens_identical"] == record["tokens"] == 4 * 32
    assert record["onnxruntime_tokens"] == record["eager_tokens"]
    assert record["calibration"] == f"{calib_text} (8 prompts, prefill + 4 decode steps)"
    assert "128/128 tokens identical, ok=True" in out
    assert json.loads((tmp_path / "genai_config.json").read_text())["model"]["decoder"]["filename"] == "llama.onnx"
    assert (tmp_path / "tokenizer.json").is_file()
    session = ort.InferenceSession(str(output), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == [
        "input_ids", "attention_mask", "position_ids", "past_key_values.0.key", "past_key_values.0.value",
        "past_key_values.1.key", "past_key_values.1.value"]
    assert [o.name for o in session.get_outputs()] == [
        "logits", "present.0.key", "present.0.value", "present.1.key", "present.1.value"]


def test_quantize_llama_with_an_int8_kv_cache_writes_int8_cache_codes_that_generate_like_eager(
        capsys, tiny_llama_dir, calib_text, tmp_path):
    import onnxruntime as ort

    output = tmp_path / "llama.onnx"
    code, out, err = _run(capsys, "quantize", str(tiny_llama_dir), "--task", "text-generation", "--preset", "w4",
                          "--kv-cache", "int8", "--calib-text", str(calib_text), "-o", str(output))
    assert code == 0, err
    record = json.loads(output.with_name("llama.generation.json").read_text())
    assert record["ok"] is True and record["tokens_identical"] == record["tokens"] == 4 * 32
    session = ort.InferenceSession(str(output), providers=["CPUExecutionProvider"])
    assert {i.type for i in session.get_inputs()[3:]} == {o.type for o in session.get_outputs()[1:]} == {"tensor(int8)"}


def test_int8_kv_cache_without_the_text_generation_task_is_refused(capsys, tiny_bert_dir):
    code, _, err = _run(capsys, "quantize", str(tiny_bert_dir), "--kv-cache", "int8")
    assert code == 2 and "--kv-cache int8 quantizes a decoder's KV cache; it needs --task text-generation" in err


def test_text_generation_task_on_an_encoder_or_with_plain_path_options_is_refused(capsys, tiny_bert_dir, calib_text):
    code, _, err = _run(capsys, "quantize", str(tiny_bert_dir), "--task", "text-generation", "--calib-text",
                        str(calib_text), "--seq-len", str(SEQ_LEN))
    assert code == 2 and "needs a Hugging Face save_pretrained directory of a causal LM" in err
    assert "BertForSequenceClassification" in err
    code, _, err = _run(capsys, "quantize", str(tiny_bert_dir), "--task", "text-generation", "--smoothquant")
    assert code == 2 and "drop --smoothquant" in err
